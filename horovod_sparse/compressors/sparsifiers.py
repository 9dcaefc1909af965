"""Sparsifying compressors: top-k, Ok-Topk, Gaussiank, threshold, DGC, gTop-k.

Each rank keeps different indices, so Horovod's dense allreduce cannot carry these
exchanges: they are *out-of-band* compressors. The frontends flatten a step's gradients
into one float32 buffer of length n (or one buffer per gradient) and call
``compressor.make_pipeline(n, comm)`` once per buffer, then
``sparsifier.step_sparse(grad, tag=...)`` (or ``step``, densified) every step on every
rank; the sparsifier (:class:`horovod_sparse.sparsify.Sparsifier`) returns the SUM over
ranks of what the ranks sent, in the buffer's library and device (numpy or torch).
``compress``/``decompress`` are not used.

Target count per buffer: k = max(1, ceil(density * n)) (n > 0).

References: Ok-Topk, Li & Hoefler, PPoPP'22; Gaussiank, Shi et al. 2019
("Understanding Top-k Sparsification..."); gTop-k, Shi et al., ICDCS'19; DGC, Lin
et al., ICLR'18; TopkA / TopkDSA (SparCML, Renggli et al., SC'19).
"""

from horovod_sparse.compressors.base import (OutOfBandCompressor, check_bool, check_choice, check_fraction,
                                             check_positive_int, check_positive_number, check_unit_interval)
from horovod_sparse.sparsify import selection
from horovod_sparse.sparsify.selection import k_for
from horovod_sparse.sparsify.sparsifier import Sparsifier
from horovod_sparse.warmup import Warmup
from horovod_sparse.warmup import warmup_steps as checked_warmup

#: exchanges a compressor with an exact top-k selection can use
TOPK_EXCHANGES = ("allgather", "oktopk", "gtopk", "dsa")
#: exchanges for threshold-based selections, whose counts differ between ranks
#: (the oktopk/gtopk exchanges assume about k entries per rank)
THRESHOLD_EXCHANGES = ("allgather", "dsa")


class SparsifyingCompressor(OutOfBandCompressor):
    """Base of the sparsifying compressors: an out-of-band compressor with a target count k."""

    sparse_result = True
    tensorflow_ops = True

    def k_for(self, n):
        """Target number of entries for a buffer of ``n`` elements."""
        return k_for(self.density, n)


class TopKCompressor(SparsifyingCompressor):
    """Exact top-k by magnitude of the accumulated gradient (TopkA with the default exchange).

    Args:
        density: fraction of the buffer each rank sends per step, in (0, 1].
        error_feedback: keep what was not consumed in a residual (strongly advised).
        exchange: "allgather" (TopkA, 2k(P-1) pairs per rank), "oktopk" (Ok-Topk's
            sparse allreduce, global top-k, < 6k pairs), "gtopk" (gTop-k tree, global
            top-k) or "dsa" (TopkDSA, sparse-or-dense regions).
        warmup_steps: the first warmup_steps steps send the whole buffer through a dense
            allreduce (residual cleared; behind PyTorch's ``hvd.DistributedOptimizer``
            Horovod's own allreduce carries them); over the next warmup_steps the density falls
            geometrically from 1 to ``density`` (DGC's warm-up; with "allgather" and "dsa"
            only). An integer >= 0; default ``$HOROVOD_SPARSE_WARMUP_STEPS``, else 100
            (:mod:`horovod_sparse.warmup`; what it buys: docs/results/accuracy.md).
    """

    name = "topk"

    def __init__(self, density=0.01, error_feedback=True, exchange="allgather", warmup_steps=None):
        super().__init__()
        self.density = check_fraction("density", density)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.exchange = check_choice("exchange", exchange, TOPK_EXCHANGES)
        self.warmup_steps = checked_warmup(warmup_steps)
        self.params = dict(density=self.density, error_feedback=self.error_feedback,
                           exchange=self.exchange, warmup_steps=self.warmup_steps)

    @property
    def ramps(self):
        """Whether the warm-up's density ramps down (only a threshold exchange takes any count)."""
        return self.exchange in THRESHOLD_EXCHANGES

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.TopKRule(), self.k_for(n), exchange=self.exchange,
                          error_feedback=self.error_feedback, warmup_steps=self.warmup_steps,
                          ramp=self.ramps)

    def dense_steps(self, size):
        """The warm-up's dense steps, then its ramp's first steps, while every pipeline's count
        reaches n / P (each pipeline's k / n is at least ``density``, so its ramp count is at least
        the one :meth:`~horovod_sparse.warmup.Warmup.dense_steps` reads)."""
        return Warmup(self.warmup_steps, ramp=self.ramps).dense_steps(self.density, size)


class OkTopKCompressor(SparsifyingCompressor):
    """Ok-Topk (Li & Hoefler, PPoPP'22): local threshold, Ok-Topk sparse allreduce.

    Args:
        density: target fraction of the buffer selected locally and globally, in (0, 1].
        tau: steps between repartitions of the index space among ranks (>= 1).
        tau_prime: steps between exact recomputations of the local and global
            thresholds (>= 1); in between they are nudged by x1.012 or /1.012.
        warmup_steps: number of first steps exchanged densely (whole buffer, residual
            cleared; behind PyTorch's ``hvd.DistributedOptimizer`` Horovod's own allreduce
            carries them), an integer >= 0; default ``$HOROVOD_SPARSE_WARMUP_STEPS``, else 100
            (:mod:`horovod_sparse.warmup`).
        error_feedback: keep what was not consumed in a residual; cleared only at
            indices selected both locally and globally.
    """

    name = "oktopk"

    def __init__(self, density=0.01, tau=64, tau_prime=32, warmup_steps=None, error_feedback=True):
        super().__init__()
        self.density = check_fraction("density", density)
        self.tau = check_positive_int("tau", tau)
        self.tau_prime = check_positive_int("tau_prime", tau_prime)
        self.warmup_steps = checked_warmup(warmup_steps)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.params = dict(density=self.density, tau=self.tau, tau_prime=self.tau_prime,
                           warmup_steps=self.warmup_steps, error_feedback=self.error_feedback)

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.OkTopkLocalRule(self.tau_prime), self.k_for(n),
                          exchange="oktopk", error_feedback=self.error_feedback,
                          warmup_steps=self.warmup_steps,
                          exchange_params=dict(tau=self.tau, tau_prime=self.tau_prime))


class GaussianKCompressor(SparsifyingCompressor):
    """Gaussiank: threshold |mu| + |Phi^-1(density/2)| * sigma of the accumulated gradient,
    corrected so each rank's count lies in [ceil(k/2), 2k].

    Args:
        density: target fraction of the buffer each rank sends, in (0, 1].
        error_feedback: keep what was not sent in a residual.
        exchange: "allgather" or "dsa" (counts differ between ranks).
    """

    name = "gaussiank"

    def __init__(self, density=0.01, error_feedback=True, exchange="allgather"):
        super().__init__()
        self.density = check_fraction("density", density)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.exchange = check_choice("exchange", exchange, THRESHOLD_EXCHANGES)
        self.params = dict(density=self.density, error_feedback=self.error_feedback,
                           exchange=self.exchange)

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.GaussianRule(self.density), self.k_for(n),
                          exchange=self.exchange, error_feedback=self.error_feedback)


class ThresholdCompressor(SparsifyingCompressor):
    """Fixed threshold: every entry with |accumulated gradient| >= value is sent.

    Args:
        value: magnitude threshold in the gradient's units (finite, > 0). The count
            per step is anything from 0 to n.
        error_feedback: keep what was not sent in a residual.
        exchange: "allgather" or "dsa" (DSA switches a region to dense when the
            sparse form would be larger, which bounds the volume when many pass).
    """

    name = "threshold"

    def __init__(self, value=1e-3, error_feedback=True, exchange="allgather"):
        super().__init__()
        self.value = check_positive_number("value", value)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.exchange = check_choice("exchange", exchange, THRESHOLD_EXCHANGES)
        self.params = dict(value=self.value, error_feedback=self.error_feedback,
                           exchange=self.exchange)

    def k_for(self, n):
        return 0  # no target count: the threshold decides

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.ThresholdRule(self.value), 0, exchange=self.exchange,
                          error_feedback=self.error_feedback)


class DGCCompressor(SparsifyingCompressor):
    """Deep Gradient Compression (Lin et al., ICLR'18): momentum correction, sampled threshold,
    momentum factor masking.

    u = momentum * u + grad; v = v + u; send v where |v| >= a threshold estimated from a
    random sample of v (corrected so the count lies in [ceil(k/2), 2k]); clear u and v
    there. The momentum is applied here, so the optimizer must be plain SGD without
    momentum. Not included: DGC's local gradient clipping and its sparsity warm-up.

    Args:
        density: target fraction of the buffer each rank sends, in (0, 1].
        momentum: momentum factor in [0, 1).
        sample_fraction: fraction of the buffer sampled to estimate the threshold, in (0, 1].
        exchange: "allgather" or "dsa".
    """

    name = "dgc"

    def __init__(self, density=0.001, momentum=0.9, sample_fraction=0.01, exchange="allgather"):
        super().__init__()
        self.density = check_fraction("density", density)
        self.momentum = check_unit_interval("momentum", momentum)
        self.sample_fraction = check_fraction("sample_fraction", sample_fraction)
        self.exchange = check_choice("exchange", exchange, THRESHOLD_EXCHANGES)
        self.params = dict(density=self.density, momentum=self.momentum,
                           sample_fraction=self.sample_fraction, exchange=self.exchange)

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.SampledRule(self.density, self.sample_fraction),
                          self.k_for(n), exchange=self.exchange, momentum=self.momentum)


class GTopKCompressor(SparsifyingCompressor):
    """gTop-k (Shi et al., ICDCS'19): local exact top-k, tree merge keeping the global top-k.

    Args:
        density: fraction of the buffer selected locally and globally, in (0, 1].
        error_feedback: keep what was not consumed (cleared at local ∩ global) in a residual.
    """

    name = "gtopk"

    def __init__(self, density=0.01, error_feedback=True):
        super().__init__()
        self.density = check_fraction("density", density)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.params = dict(density=self.density, error_feedback=self.error_feedback)

    def make_pipeline(self, n, comm, layout=None):
        return Sparsifier(n, comm, selection.TopKRule(), self.k_for(n), exchange="gtopk",
                          error_feedback=self.error_feedback)
