"""FFT-based gradient sparsification with range-based float codes (Wang et al., HPDC'20).

The fused buffer is cut into chunks, each chunk goes to the frequency domain (real FFT),
the low-energy coefficients are dropped, the kept ones travel as low-bit range-based
floats through a sparse allreduce, and the sum is transformed back. Error feedback
keeps what was dropped or rounded away. See :mod:`horovod_sparse.fft.pipeline`.
"""
from horovod_sparse.compressors.base import (OutOfBandCompressor, check_bool, check_choice,
                                             check_nonnegative_int, check_positive_int,
                                             check_unit_interval)
from horovod_sparse.fft.pipeline import EXCHANGES, FFTSparsifier
from horovod_sparse.quantize.rangefloat import SPLITS


class FFTCompressor(OutOfBandCompressor):
    """Drop the fraction ``theta`` of lowest-energy FFT coefficients, send the rest as
    ``bits``-bit range-based floats.

    Args:
        theta: fraction of the complex coefficients DROPPED each step, in [0, 1).
            Default 0.9: 10% of the coefficients are kept, which carries most of a
            gradient's energy when it is smooth along the buffer, and with 8-bit codes
            and int32 positions costs about 0.5 byte per gradient element per peer (the
            positions dominate), 8x less than float32.
        bits: bits per value, one of 4, 8, 12, 16. Default 8 (1 sign, 4 exponent, 3
            mantissa bits: relative error <= 1/16 inside a 15-binade window per block),
            small next to the 4-byte position and the error the drop already makes.
        chunk_size: elements per transformed chunk, >= 2. Default 1024: on the gradients
            of a digits MLP (studies/fft_chunk_study.py, docs/fft.md) shorter chunks keep
            more of the gradient's energy at a given theta (0.854 at 1024, 0.834 at 4096,
            0.630 for one transform of the whole buffer); float32 transforms take about
            the same time at 256, 1024 and 4096.
        exchange: "allgather" (every rank's kept coefficients to all, volume grows with
            P; the default, exact sum of what every rank kept) or "oktopk" (Ok-Topk
            sparse allreduce with a global selection of the summed spectrum, volume
            < 6k per rank).
        theta_final: theta reached after ``decay_steps`` steps of a linear schedule, in
            [0, 1); default theta (constant). The paper lowers theta over training.
        decay_steps: steps of the linear decay from theta to theta_final (>= 0; 0 keeps
            theta constant).
        error_feedback: keep what was not sent (dropped coefficients, rounding of the
            codes, for oktopk what the global selection dropped) in a residual.
    """

    name = "fft"
    #: TensorFlow on a GPU (or with on_device=True): the step as TensorFlow ops where the
    #: gradients are (tf.signal's transforms: within float32 FFT rounding of the numpy path)
    tensorflow_ops = True

    def __init__(self, theta=0.9, bits=8, chunk_size=1024, exchange="allgather", theta_final=None,
                 decay_steps=0, error_feedback=True):
        super().__init__()
        self.theta = check_unit_interval("theta", theta)
        if isinstance(bits, bool) or bits not in SPLITS:
            raise ValueError(f"bits must be one of {sorted(SPLITS)}, got {bits!r}")
        self.bits = int(bits)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        if self.chunk_size < 2:
            raise ValueError(f"chunk_size must be an integer in [2, {2**31 - 1}], got {chunk_size!r}")
        self.exchange = check_choice("exchange", exchange, EXCHANGES)
        self.theta_final = self.theta if theta_final is None else check_unit_interval("theta_final",
                                                                                      theta_final)
        self.decay_steps = check_nonnegative_int("decay_steps", decay_steps, upper=2**31 - 1)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        # theta_final is stored resolved so that the spec string parses back (no None)
        self.params = dict(theta=self.theta, bits=self.bits, chunk_size=self.chunk_size,
                           exchange=self.exchange, theta_final=self.theta_final,
                           decay_steps=self.decay_steps, error_feedback=self.error_feedback)

    @property
    def theta_schedule(self):
        return "linear" if self.decay_steps > 0 and self.theta_final != self.theta else "constant"

    def make_pipeline(self, n, comm, layout=None):
        return FFTSparsifier(n, comm, theta=self.theta, bits=self.bits, chunk_size=self.chunk_size,
                             exchange=self.exchange, theta_schedule=self.theta_schedule,
                             theta_final=self.theta_final, decay_steps=self.decay_steps,
                             error_feedback=self.error_feedback)
