"""Quantizing compressors: bf16, QSGD, int4, TernGrad, signSGD, Signum, EF-signSGD, 1-bit SGD, and
the float32 "dense" sum (no compression; the schedules' baseline).

Their codes are bit-packed with per-bucket or per-vector headers, which Horovod's dense
allreduce cannot sum: they are *out-of-band* compressors. The frontends flatten a step's
gradients into one float32 buffer of length n and call
``compressor.make_pipeline(n, comm)`` once per buffer, then ``pipeline.step(grad,
tag=...)`` every step on every rank; the pipeline
(:class:`horovod_sparse.quantize.pipeline.QuantizedPipeline`) returns the SUM over
ranks of what the ranks sent, as decoded.

Exchange (``method``), for all of them:

* ``"alltoall"`` (default): DeepSpeed 1-bit Adam's compressed allreduce - each rank
  owns 1/P of the buffer, receives everyone's code of it, sums, re-encodes the sum and
  allgathers it. About 2 (P-1)/P * code size sent per rank, whatever P; at P >= 3 the
  sum is quantized twice (for the error-feedback codecs the owners keep a server
  residual); at P = 2 the ranks allgather their chunk codes and each decodes and sums
  them in rank order: the same bytes, quantized once.
* ``"allgather"``: GRACE's allgather - every rank's code goes to every rank, which
  decodes and sums. (P-1) * code size per rank, but quantized once.

All of them have a TensorFlow spelling (``tensorflow_ops``): on a GPU, or with
``on_device=True``, the TensorFlow frontend runs their step as TensorFlow ops on the fused
gradient (memory, scaling, the stochastic codes from the same counter-based stream, bit
packing), only the packed codes cross to numpy for MPI, and the result is the numpy path's,
bit for bit.

Code sizes per value (headers aside): bf16 16 bits, qsgd 1 + ceil(log2(levels + 1))
bits (6 for 16 levels) plus 4 bytes per bucket, int4 ``bits`` (4) plus 4 bytes per bucket,
terngrad 2 bits, the sign codes 1 bit.
"""
from horovod_sparse.compressors.base import (OutOfBandCompressor, check_bool, check_choice, check_int,
                                             check_positive_int, check_unit_interval)
from horovod_sparse.exchange.plain_sum import PlainSumPipeline
from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.codec import Float32Codec
from horovod_sparse.quantize.codecs import (BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec,
                                            TernGradCodec)
from horovod_sparse.quantize.onebit_buckets import BucketedOneBitCodec
from horovod_sparse.quantize.pipeline import QuantizedPipeline

#: how a quantizer's codes are exchanged (see the module docstring)
METHODS = ("alltoall", "allgather")


class QuantizingCompressor(OutOfBandCompressor):
    """Base of the quantizers: a codec, an exchange method, error feedback or momentum."""

    error_feedback = False
    momentum = None
    #: the codecs, the memory and the exchange have TensorFlow spellings (module docstring)
    tensorflow_ops = True

    def __init__(self, method, error_feedback=None, **own_params):
        """Check and record ``method`` and, for the compressors that offer it,
        ``error_feedback``; ``own_params`` (already checked) come first in ``params``."""
        super().__init__()
        self.method = check_choice("method", method, METHODS)
        self.params = dict(own_params, method=self.method)
        if error_feedback is not None:
            self.error_feedback = check_bool("error_feedback", error_feedback)
            self.params["error_feedback"] = self.error_feedback

    def codec(self):
        """The :class:`~horovod_sparse.quantize.ValueCodec` on the wire."""
        raise NotImplementedError

    def make_pipeline(self, n, comm, layout=None):
        return QuantizedPipeline(n, comm, self.codec(), method=self.method,
                                 error_feedback=self.error_feedback, momentum=self.momentum)


class DenseCompressor(OutOfBandCompressor):
    """No compression, exchanged out of band: the float32 sum over ranks (the schedules' baseline).

    What Horovod's own allreduce computes, but run by this package's exchange, so that the
    schedules (``schedule="wfbp"``, ``"mgwfbp"``, ``"optimal"``, ``"asc"``, ``"auto"``) can
    be compared on dense gradients with Horovod's fusion, as the ASC-WFBP paper does. In the
    step benchmark a plain ``dense`` is Horovod's own ``Compression.none``; ``dense:...``
    with parameters is this one.

    Args:
        method: "allreduce" (default: one ``MPI_Allreduce``, as Horovod sums), "alltoall"
            (the quantizers' exchange with a float32 code: each rank sums one 1/P chunk,
            then the chunks are allgathered) or "allgather" (every rank sums all P buffers).

    Example::

        compression = horovod_sparse.torch.Compression.dense(schedule="mgwfbp")
    """

    name = "dense"
    #: the float32 code, and the plain sum's host crossing, have TensorFlow spellings
    tensorflow_ops = True

    def __init__(self, method="allreduce"):
        super().__init__()
        self.method = check_choice("method", method, ("allreduce",) + METHODS)
        self.params = {"method": self.method}

    def codec(self):
        """The code of the "alltoall" and "allgather" methods: float32 itself."""
        return Float32Codec()

    def make_pipeline(self, n, comm, layout=None):
        if self.method == "allreduce":
            return PlainSumPipeline(n, comm)
        return QuantizedPipeline(n, comm, self.codec(), method=self.method, error_feedback=False)


class BF16Compressor(QuantizingCompressor):
    """bfloat16 on the wire: 16 bits per value, round to nearest even, relative error <= 2**-8.

    Not a paper's method: the common half-precision baseline (8 exponent bits, so no
    overflow where fp16 would). Deterministic.

    Args:
        method: "alltoall" (default; the owner's sum is rounded to bfloat16 a second
            time) or "allgather" (rounded once; sends (P-1) times the buffer's code).
        error_feedback: keep the rounding error in a residual (default False).
    """

    name = "bf16"

    def __init__(self, method="alltoall", error_feedback=False):
        super().__init__(method, error_feedback)

    def codec(self):
        return BF16Codec()


class QSGDCompressor(QuantizingCompressor):
    """QSGD (Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization
    and Encoding", NeurIPS'17): per bucket the L2 norm, per value a sign and an unbiased
    stochastic level in {0, .., levels}.

    Args:
        levels: number of quantization levels s, integer in [1, 32767] (default 16:
            6 bits per value).
        bucket_size: values per bucket (d) sharing one float32 norm, integer in
            [1, 2**31 - 1] (default 512).
        method: "alltoall" (default) or "allgather".
        error_feedback: keep the quantization error in a residual (default False; QSGD
            is unbiased without it).
    """

    name = "qsgd"

    def __init__(self, levels=16, bucket_size=512, method="alltoall", error_feedback=False):
        self.levels = check_positive_int("levels", levels, upper=2 ** 15 - 1)
        self.bucket_size = check_positive_int("bucket_size", bucket_size)
        super().__init__(method, error_feedback, levels=self.levels, bucket_size=self.bucket_size)

    def codec(self):
        return QSGDCodec(self.levels, self.bucket_size)


class Int4Compressor(QuantizingCompressor):
    """4-bit absmax levels with error feedback (CocktailSGD's code: per bucket of 128 values
    its max |x|; LoCo, arXiv 2407.04480: 4 bits with the error compensated): each value the
    nearest of {-L, .., L} * max / L, L = 2**(bits - 1) - 1, ties to even; deterministic,
    so the error feedback (on by default) is what makes it unbiased over the steps. Several
    times less error per value than qsgd at the same bits (docs/quantizers.md).

    Args:
        bits: bits per value, integer in [2, 8] (default 4: L = 7).
        bucket_size: values per bucket sharing one float32 scale, integer in
            [1, 2**31 - 1] (default 128: 0.53 bytes per value at 4 bits).
        method: "alltoall" (default) or "allgather".
        error_feedback: keep the rounding error in a residual (default True).
    """

    name = "int4"

    def __init__(self, bits=4, bucket_size=128, method="alltoall", error_feedback=True):
        self.bits = check_int("bits", bits, 2, 8)
        self.bucket_size = check_positive_int("bucket_size", bucket_size)
        super().__init__(method, error_feedback, bits=self.bits, bucket_size=self.bucket_size)

    def codec(self):
        return Int4Codec(self.bits, self.bucket_size)


class TernGradCompressor(QuantizingCompressor):
    """TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning", NeurIPS'17): scale max|x| per encoded vector, each value
    an unbiased stochastic choice in {-1, 0, +1} times the scale (2 bits per value).
    TernGrad's gradient clipping is not applied.

    Args:
        method: "alltoall" (default; the scale is per chunk of 1/P of the buffer) or
            "allgather" (one scale per buffer).
        error_feedback: keep the quantization error in a residual (default False).
    """

    name = "terngrad"

    def __init__(self, method="alltoall", error_feedback=False):
        super().__init__(method, error_feedback)

    def codec(self):
        return TernGradCodec()


class SignSGDCompressor(QuantizingCompressor):
    """signSGD with majority vote (Bernstein et al., "signSGD: Compressed Optimisation for
    Non-Convex Problems", ICML'18, and "signSGD with Majority Vote...", ICLR'19): each rank
    sends sign(grad) (1 bit per value, sign(0) = +1); the result is P * sign(sum of the
    signs), i.e. the Average is the majority vote +-1. No error feedback. Use with a small
    learning rate (the update magnitude is 1 per element).

    Args:
        method: "alltoall" (default) or "allgather"; both give the same vote.
    """

    name = "signsgd"

    def __init__(self, method="alltoall"):
        super().__init__(method)

    def codec(self):
        return SignCodec()


class SignumCompressor(QuantizingCompressor):
    """Signum (Bernstein et al., ICML'18): signSGD with majority vote on the momentum.
    Each rank keeps u = momentum * u + grad and sends sign(u); the result is
    P * sign(sum of the signs). The momentum is applied here, so use plain SGD without
    momentum as the optimizer.

    Args:
        momentum: momentum factor in [0, 1) (default 0.9; 0 is signSGD).
        method: "alltoall" (default) or "allgather".
    """

    name = "signum"

    def __init__(self, momentum=0.9, method="alltoall"):
        self.momentum = check_unit_interval("momentum", momentum)
        super().__init__(method, momentum=self.momentum)

    def codec(self):
        return SignCodec()


class EFSignSGDCompressor(QuantizingCompressor):
    """EF-signSGD (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML'19): each rank sends mean|x| * sign(x) of x = grad +
    residual (1 bit per value and one float32 scale per encoded vector) and keeps the
    difference in the residual; contributions are summed (no vote).

    Args:
        method: "alltoall" (default; owners keep a server residual too) or "allgather".
        error_feedback: keep the residual (default True; the method needs it).
    """

    name = "efsignsgd"

    def __init__(self, method="alltoall", error_feedback=True):
        super().__init__(method, error_feedback)

    def codec(self):
        return ScaledSignCodec()


class OneBitCompressor(QuantizingCompressor):
    """1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
    Data-Parallel Distributed Training of Speech DNNs", Interspeech'14): 1 bit per value
    choosing one of two float32 reconstruction values (the means of the non-negative and
    of the negative entries), with error feedback.

    Args:
        bucket_size: values per bucket with its own two means, integer in [1, 2**31 - 1], or
            None (default: two means per encoded vector, as the paper). Buckets fit the
            scales of a transformer's rows: at 256, 1.25 bits a value and about two thirds
            of the error per encode on the byte transformer (docs/quantizers.md).
        method: "alltoall" (default; owners keep a server residual too) or "allgather".
        error_feedback: keep the quantization error in a residual (default True; the
            method needs it).

    Example::

        compression = horovod_sparse.torch.Compression.onebit(bucket_size=256)
    """

    name = "onebit"

    def __init__(self, bucket_size=None, method="alltoall", error_feedback=True):
        self.bucket_size = None if bucket_size is None else check_positive_int("bucket_size", bucket_size)
        super().__init__(method, error_feedback, **({} if bucket_size is None else {"bucket_size": self.bucket_size}))

    def codec(self):
        return OneBitCodec() if self.bucket_size is None else BucketedOneBitCodec(self.bucket_size)
