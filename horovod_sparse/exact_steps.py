"""The exact-step schedule: which steps send the average gradient uncompressed.

An Adam under compression keeps its second moment ``v`` from exact steps only
(:class:`horovod_sparse.torch.AdamW`; 0/1 Adam, Lu et al. 2022): a sparse or coarse average
inflates or starves ``v`` per coordinate, and Adam divides every coordinate by it. ``v`` changes
slowly (beta2 = 0.999 remembers about 1000 steps), so it needs exact samples often early in
training and rarely later. :class:`ExactSteps` is that schedule: the first ``warmup`` steps are
all exact, then the intervals between exact steps double from 1 up to ``max_interval``, then
stay there. With ``warmup=4, max_interval=4`` the exact steps are 0-3, then 4, 5, 7, 11, 15, ...

Like :class:`~horovod_sparse.warmup.Warmup` it depends only on a step counter that every rank
has the same, that a checkpoint saves and that a skipped (overflowed) step does not advance:
the compressor's count of steps taken (:class:`~horovod_sparse.torch.TorchOutOfBandCompressor`)
and the optimizer's, which must agree.

    >>> s = ExactSteps(warmup=4, max_interval=4)
    >>> [step for step in range(24) if s.is_exact(step)]
    [0, 1, 2, 3, 4, 5, 7, 11, 15, 19, 23]
    >>> s.count(24), s.count(0), s.count(12)
    (11, 0, 8)
    >>> ExactSteps(warmup=0, max_interval=1).count(50)   # every step exact
    50
"""
from dataclasses import dataclass

from horovod_sparse.checks import check_nonnegative_int, check_positive_int

#: exact steps at the start (as many as the compressors' default warm-up, whose dense steps are exact too)
DEFAULT_EXACT_WARMUP = 100
#: the codes of the exact steps sent out of band (``"int8"``, ``"int6"``): absmax levels over buckets of
#: 128 values (int4's code at 8 bits, |error| <= max / 254 per value and exchange, a quarter of an
#: fp32 step's bytes; at 6 bits max / 62, a fifth), without error feedback (an exact step stands
#: alone: no residual carried from one to the next, many steps later)
EXACT_CODES = {"int8": "int4:bits=8,error_feedback=false", "int6": "int4:bits=6,error_feedback=false"}
EXACT_INT8 = EXACT_CODES["int8"]
#: how an exact step's gradients travel: as they are (``"none"``), cast to float16 (``"fp16"``,
#: as Horovod's ``Compression.fp16``: half the bytes of an fp32 exact step), or out of band in
#: 8 or 6 bits (:data:`EXACT_CODES`)
EXACT_COMPRESSIONS = ("none", "fp16") + tuple(EXACT_CODES)
#: the longest interval between exact steps; with beta2 = 0.999, a ``v`` at most 32 steps old
#: (3% of its memory). Not tuned by measurement yet.
DEFAULT_MAX_INTERVAL = 32


@dataclass(frozen=True)
class ExactSteps:
    """``warmup`` exact steps, then exact steps at intervals 1, 2, 4, ... capped at ``max_interval``;
    ``compression``, how an exact step's gradients travel (``EXACT_COMPRESSIONS``)."""

    warmup: int = DEFAULT_EXACT_WARMUP
    max_interval: int = DEFAULT_MAX_INTERVAL
    compression: str = "none"

    def __post_init__(self):
        check_nonnegative_int("exact_warmup", self.warmup, upper=2**31 - 1)
        check_positive_int("max_interval", self.max_interval)
        if self.compression not in EXACT_COMPRESSIONS:
            raise ValueError(f"exact_compression must be one of {EXACT_COMPRESSIONS}, got {self.compression!r}")

    @property
    def _doubling(self):
        """Offset after the warm-up where the intervals reach ``max_interval``: 2^J - 1, for the
        smallest J with 2^J >= max_interval (the doubling intervals 1 .. 2^(J-1) sum to it)."""
        return (1 << (self.max_interval - 1).bit_length()) - 1

    def is_exact(self, step):
        """Whether 0-based ``step`` sends the average uncompressed.

        >>> s = ExactSteps(warmup=0, max_interval=10)   # intervals 1, 2, 4, 8, then 10
        >>> [step for step in range(40) if s.is_exact(step)]
        [0, 1, 3, 7, 15, 25, 35]
        """
        offset = step - self.warmup
        if offset < 0:
            return True
        if offset < self._doubling:
            return (offset + 1) & offset == 0  # offset + 1 a power of two
        return (offset - self._doubling) % self.max_interval == 0

    def count(self, steps):
        """How many of the first ``steps`` steps are exact (for the bytes of a run: every exact
        step sends the whole gradient, the others what the compressor sends)."""
        after = steps - self.warmup
        if after <= 0:
            return max(steps, 0)
        doubling = min(after, self._doubling).bit_length()  # offsets 2^j - 1 below min(after, 2^J - 1)
        linear = 0 if after <= self._doubling else (after - 1 - self._doubling) // self.max_interval + 1
        return self.warmup + doubling + linear

    def describe(self, step):
        """One line for reports.

        >>> ExactSteps(100, 32).describe(40), ExactSteps(100, 32).describe(400)
        ('exact: every step until step 100', 'exact every 32 steps (step 400 compressed)')
        """
        if step < self.warmup:
            return f"exact: every step until step {self.warmup}"
        if step - self.warmup < self._doubling:
            return f"exact at doubling intervals up to {self.max_interval} (step {step} " \
                   f"{'exact' if self.is_exact(step) else 'compressed'})"
        return f"exact every {self.max_interval} steps (step {step} {'exact' if self.is_exact(step) else 'compressed'})"
