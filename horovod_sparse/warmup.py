"""The compression warm-up: dense steps first, then a density that tightens to its target.

Early training is where compression costs the most quality: the gradient changes fast and
the model is far from any basin, so what error feedback delays is out of date when it
arrives. Under AdamW it is worse: Adam normalises every coordinate by its own history, so a
coordinate that a 1% selection sends once in a hundred steps moves several times less than
under dense training (the burst's displacement is capped by Adam's momentum and inflated
second moment). The literature's answer is to compress less at the start: DGC (Lin et al.,
ICLR'18) lowers the density exponentially over the first epochs, Ok-Topk's reference and
PyTorch's ``powerSGD_hook`` (``start_powerSGD_iter``) run dense allreduces first, Accordion
(Agarwal et al., MLSys'21) compresses less in early "critical regimes". docs/results/accuracy.md
measures what it buys on the real workloads.

A :class:`Warmup` of ``steps`` is ``steps`` dense steps (every element sent, the residual
cleared), then ``steps`` steps whose density falls geometrically from 1 to the target, then
the target. It depends only on the pipeline's step counter, which every rank has the same,
which a checkpoint saves and which a skipped (overflowed) step does not advance: so the
density is the same on every rank, resumes where it was and never moves on a step that was
not taken.

    >>> w = Warmup(4)
    >>> [w.phase(s) for s in (0, 3, 4, 7, 8)]
    ['dense', 'dense', 'ramp', 'ramp', 'steady']
    >>> Warmup(4, ramp=False).phase(4)   # dense steps only (the exchanges of a fixed count)
    'steady'
    >>> [round(w.density(s, 0.01), 4) for s in (0, 4, 5, 6, 7, 8, 100)]
    [1.0, 0.3162, 0.1, 0.0316, 0.01, 0.01, 0.01]
"""
import os
from dataclasses import dataclass

from horovod_sparse.checks import check_nonnegative_int

#: steps of the default warm-up (as many dense steps, then as many ramp steps); measured in
#: docs/results/accuracy.md. PyTorch's PowerSGDState defaults to 1000 plain allreduce steps.
DEFAULT_WARMUP = 100
#: environment variable that sets the default (``0``: no warm-up unless a compressor asks)
WARMUP_ENV = "HOROVOD_SPARSE_WARMUP_STEPS"


def warmup_steps(value=None):
    """A compressor's ``warmup_steps`` argument checked, ``None`` resolved to the default:
    ``$HOROVOD_SPARSE_WARMUP_STEPS`` where set, else :data:`DEFAULT_WARMUP`.

    >>> warmup_steps(0), warmup_steps(250)
    (0, 250)
    """
    if value is None:
        value = os.environ.get(WARMUP_ENV, DEFAULT_WARMUP)
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"${WARMUP_ENV} must be an integer in [0, 2147483647], got {value!r}") from None
    return check_nonnegative_int("warmup_steps", value, upper=2**31 - 1)


@dataclass(frozen=True)
class Warmup:
    """``steps`` dense steps, then (with ``ramp``) ``steps`` steps of geometric ramp to the
    target density."""

    steps: int
    ramp: bool = True

    def phase(self, step):
        """``"dense"``, ``"ramp"`` or ``"steady"`` at 0-based ``step``."""
        if step < self.steps:
            return "dense"
        return "ramp" if self.ramp and step < 2 * self.steps else "steady"

    def dense_steps(self, target, size):
        """How many first steps send every element at ``size`` ranks, for a steady ``target``
        density: the dense steps, then the ramp's while its density is at least 1 / ``size``
        (there a sparsifier's count k reaches n / P and it sends the whole buffer: a dense sum
        sends less than P ranks' pairs would). A margin keeps rounding on the sparse side.

        >>> Warmup(100).dense_steps(0.01, 2), Warmup(100).dense_steps(0.01, 1), Warmup(100, ramp=False).dense_steps(0.01, 8)
        (115, 100, 100)
        """
        count = self.steps
        while self.phase(count) == "ramp" and self.density(count, target) * size >= 1 + 1e-9:
            count += 1
        return count

    def density(self, step, target):
        """The fraction of the buffer sent at ``step`` for a steady ``target`` density: 1 while
        dense, ``target ** (i / steps)`` at the ramp's ``i``-th step (1-based), then ``target``."""
        phase = self.phase(step)
        if phase == "dense":
            return 1.0
        if phase == "ramp":
            return max(target, target ** ((step - self.steps + 1) / self.steps))
        return target

    def describe(self, step, target):
        """One line for reports: the phase at ``step`` and its density (``target`` a density,
        or the steady compression in words).

        >>> Warmup(100).describe(150, 0.01)
        'warm-up: density 0.0955, falling to 0.01 by step 200'
        >>> Warmup(100, ramp=False).describe(150, "rank 2")
        'steady: rank 2'
        """
        phase = self.phase(step)
        if phase == "dense":
            return f"warm-up: dense until step {self.steps}"
        if phase == "ramp":
            return (f"warm-up: density {self.density(step, target):.4g}, falling to {target:g} "
                    f"by step {2 * self.steps}")
        return f"steady: density {target:g}" if isinstance(target, float) else f"steady: {target}"
