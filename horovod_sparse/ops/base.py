"""The array-operations interface, and the one random-index generator every framework shares."""
import numpy as np

from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.nonfinite import raise_with_hint
from horovod_sparse.ops import cpu
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.ops.kernels import zero_at
from horovod_sparse.slots import COMMITTED, NO_OUTCOME, OVERFLOWED

# Floating dtypes the compressors work on, by name. Names (not framework dtype objects)
# are what the math layer sees, so the same code runs over every framework.
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def random_indices(seed, stream, step, n, k):
    """Sorted int64 indices of ``k`` distinct positions in ``[0, n)``.

    Every argument is an integer. The draw depends only on ``(seed, stream, step)``,
    so ranks that agree on those agree on the indices without communicating; this is
    what lets random-k ride on Horovod's dense allreduce. ``stream`` tells tensors of
    one step apart, ``step`` tells steps apart. All frameworks call this function (the
    TensorFlow graph through ``tf.numpy_function``), so their indices are identical.
    """
    if k > n or k < 0:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([int(seed), int(stream), int(step)])))
    if k == n:
        return np.arange(n, dtype=np.int64)
    idx = rng.choice(n, size=k, replace=False, shuffle=False).astype(np.int64, copy=False)
    return sort_distinct(idx, n)


def sort_distinct(idx, n):
    """``idx`` (distinct int64 in ``[0, n)``) sorted: by the O(k) kernel of
    :mod:`horovod_sparse.ops.cpu.cast` where it is enabled (``np.sort`` takes as long as a copy
    of the gradient at density 0.01), else in place by numpy. Distinct integers: the same array."""
    if cpu.enabled() and idx.size:
        from horovod_sparse.ops.cpu.cast import sort_distinct as kernel
        return kernel(idx, n)
    idx.sort()
    return idx


class ArrayOps:
    """What a compressor may do to a tensor. One subclass per framework.

    Tensors are the framework's own type; shapes are tuples of ints; dtypes are the
    names in ``FLOAT_DTYPES`` or the framework's other dtype names. A *slot* is the
    per-tensor state of a stateful compressor (:class:`horovod_sparse.slots.Slot`); the
    ops decide how its residual and step are stored (plain tensors, or ``tf.Variable``
    inside a TensorFlow graph).
    """

    name = "abstract"

    # -- inspection -----------------------------------------------------------
    def dtype_name(self, t):
        raise NotImplementedError

    def shape(self, t):
        raise NotImplementedError

    def numel(self, t):
        return self.numel_of(self.shape(t))

    def is_float(self, t):
        return self.dtype_name(t) in FLOAT_DTYPES

    def nbytes(self, t):
        return self.numel(t) * self.itemsize(self.dtype_name(t))

    @staticmethod
    def itemsize(dtype_name):
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
                "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8}.get(dtype_name, 4)

    # -- element-wise and shape ------------------------------------------------
    def cast(self, t, dtype_name):
        raise NotImplementedError

    def reshape(self, t, shape):
        raise NotImplementedError

    def flatten(self, t):
        return self.reshape(t, (self.numel(t),))

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def zeros(self, shape, dtype_name, like=None):
        """Zeros on ``like``'s device (where the framework has devices)."""
        raise NotImplementedError

    # -- the wire: Horovod's allreduce carries the payload ---------------------------
    def cast_to_wire(self, t, dtype_name, slot=None):
        """``t`` cast to ``dtype_name`` for the allreduce. Frameworks with mutable tensors write it
        into the slot's wire buffer (``slot.wire``, reused every step: a fresh 50 MB tensor costs
        its page faults, five times the conversion); here, and without a slot, a new tensor."""
        return self.cast(t, dtype_name)

    def cast_back(self, t, dtype_name, out=None):
        """The reduced payload ``t`` in the gradient's ``dtype_name``: written into ``out`` (the
        gradient, free to overwrite) where the framework can, else a new tensor."""
        return self.cast(t, dtype_name)

    # -- sparse ----------------------------------------------------------------
    def gather(self, flat, indices):
        """``flat[indices]`` for a 1-D tensor."""
        raise NotImplementedError

    def scatter(self, indices, values, n):
        """A dense 1-D tensor of length ``n``: ``values`` at ``indices``, zero elsewhere."""
        raise NotImplementedError

    # Random-k's error feedback, in the two phases of horovod_sparse.memory: compress works on
    # acc = grad + residual without changing the slot; decompress commits it only once the
    # reduced payload shows that no rank overflowed, and the step is settled when the next one
    # begins (horovod_sparse.slots, horovod_sparse.nonfinite). Frameworks with mutable tensors
    # write acc into a spare buffer of the slot and swap it in on commit (a new 100 MB buffer
    # per call costs its page faults, more than the math); TensorFlow's tensors are immutable,
    # so it overrides with functional ops and variables. The values are the same bits.
    def accumulate(self, slot, t):
        """``t + residual``: the step's working copy (a buffer the caller owns); the slot is
        untouched until :meth:`commit_if`."""
        return self.add(t, self.read_residual(slot))

    def pick(self, slot, flat, indices, error_feedback=True):
        """Random-k's compress after the draw: ``(values, residual)``, where ``acc = flat +
        residual`` (:meth:`accumulate`; ``flat`` itself without error feedback), ``values =
        acc[indices]`` (all NaN unless ``acc`` is finite) and ``residual`` is ``acc`` zeroed at
        ``indices`` (None without error feedback), to commit in decompress. ``flat`` is not
        written. Here the separate passes; PyTorch on a CPU fuses them into one
        (:mod:`horovod_sparse.ops.cpu.cast`)."""
        acc = self.accumulate(slot, flat) if error_feedback else flat
        finite = self.all_finite(acc)
        values = self.nan_unless(finite, self.gather(acc, indices))
        return values, (self.zero_at_(acc, indices) if error_feedback else None)

    def zero_at_(self, flat, indices):
        """``flat`` with zeros at ``indices``, in place (``flat`` is the working copy from
        :meth:`accumulate`, which the caller owns)."""
        return zero_at(flat, indices)

    def all_finite(self, t):
        """Whether every element of ``t`` is finite: a bool here (one reduction, exact:
        :func:`horovod_sparse.ops.finite.all_finite`); a 0-d bool tensor in a TensorFlow graph
        and for a PyTorch tensor on a GPU (no synchronisation)."""
        with np.errstate(over="ignore", invalid="ignore"):  # inf + -inf in the sum: expected here
            return all_finite(self.flatten(t))

    def nan_unless(self, flag, t):
        """``t`` where ``flag`` holds, else ``t`` filled with NaN (``t`` is the caller's own)."""
        return t if flag else self.fill_nan_(t)

    def fill_nan_(self, t):
        """``t`` filled with NaN, in place where the framework allows."""
        raise NotImplementedError

    def commit_if(self, flag, slot, residual, result):
        """Where ``flag`` holds, make ``residual`` (None: no error feedback) the slot's residual,
        advance its step and record :data:`~horovod_sparse.slots.COMMITTED` (rolled back by
        :meth:`settle` if another gradient of the step overflowed); else leave the slot as it
        was and record :data:`~horovod_sparse.slots.OVERFLOWED`. Returns ``result`` (in a
        TensorFlow graph, made to wait for the commit, so that fetching it runs the commit)."""
        if flag:
            if residual is not None:
                self.write_residual(slot, residual)
            self.advance_step(slot)
            self.write_outcome(slot, COMMITTED)
        else:
            self.release_residual(slot, residual)
            self.write_outcome(slot, OVERFLOWED)
        return result

    def release_residual(self, slot, residual):
        """A working copy that was not committed: the slot may reuse its buffer."""

    def settle(self, slots):
        """End the step not yet settled: if any of ``slots`` overflowed in it, roll back those
        that committed, so that the whole step leaves no trace (every rank decides the same:
        the outcomes follow from the reduced payloads). Returns what a TensorFlow graph's
        reads of the state must wait for (None here)."""
        outcomes = [(slot, self.read_outcome(slot)) for slot in slots]
        overflowed = any(outcome == OVERFLOWED for _, outcome in outcomes)
        for slot, outcome in outcomes:
            if overflowed and outcome == COMMITTED:
                self.roll_back(slot)
            if outcome != NO_OUTCOME:
                self.write_outcome(slot, NO_OUTCOME)

    def roll_back(self, slot):
        """Undo the slot's last commit: the residual before it (kept in ``slot.spare``) and step."""
        if slot.spare is not None:
            slot.residual, slot.spare = slot.spare, slot.residual
        slot.step -= 1

    def read_outcome(self, slot):
        return slot.outcome

    def write_outcome(self, slot, outcome):
        slot.outcome = outcome

    def raise_unless_finite(self, flag, message, result):
        """``result``, or ``NonFiniteGradientError(message)`` (with what the user can do) where
        ``flag`` does not hold: raised here, or by the TensorFlow graph when it runs."""
        if not flag:
            raise_with_hint(NonFiniteGradientError(message))
        return result

    def scatter_into(self, out, indices, values, n):
        """:meth:`scatter`, written into ``out`` (a tensor of ``n`` elements that is free to
        overwrite, e.g. the gradient Horovod handed to ``compress``) where the framework can."""
        return self.scatter(indices, values, n)

    def random_indices(self, seed, stream, step, n, k, like=None):
        """:func:`random_indices` as a tensor on ``like``'s device (``step`` may be a tensor)."""
        raise NotImplementedError

    # -- slot storage -------------------------------------------------------------
    def init_slot(self, slot, residual_dtype, like, saved=None):
        """Give a new slot a zero residual (flat, ``residual_dtype``, on ``like``'s device) and
        step 0, or the ``saved`` ``(numpy residual, int step)`` of a checkpoint."""
        slot.residual = self.zeros((self.numel_of(slot.shape),), residual_dtype, like)
        slot.step = 0
        if saved is not None:
            self.load_slot(slot, *saved)

    def load_slot(self, slot, residual, step):
        """Restore an initialised slot from a numpy residual and an int step."""
        self.check_saved_residual(slot, residual)
        slot.residual = self.from_numpy(residual, like=slot.residual)
        slot.step = int(step)
        slot.spare, slot.outcome = None, NO_OUTCOME

    def check_saved_residual(self, slot, residual):
        """Raise ValueError unless ``residual`` (numpy) fits the slot's gradient."""
        if residual.shape != (self.numel_of(slot.shape),):
            raise ValueError(f"saved residual of slot {slot.key!r} has shape {residual.shape}, "
                             f"the gradient has {self.numel_of(slot.shape)} elements")

    def slot_to_numpy(self, slot):
        """``(residual as numpy or None, step as int)``."""
        # a copy: the residual may be updated in place later (add_to_residual), and a saved
        # checkpoint must not change with it
        residual = None if slot.residual is None else np.array(self.to_numpy(self.read_residual(slot)), copy=True)
        return residual, int(self.read_step(slot))

    @staticmethod
    def numel_of(shape):
        n = 1
        for d in shape:
            n *= int(d)
        return n

    def read_residual(self, slot):
        return slot.residual

    def write_residual(self, slot, value):
        # the residual before it is kept until the step is settled (roll_back)
        slot.spare, slot.residual = slot.residual, value

    def read_step(self, slot):
        return slot.step

    def advance_step(self, slot):
        slot.step += 1

    def to_numpy(self, t):
        raise NotImplementedError

    def from_numpy(self, a, like=None):
        raise NotImplementedError

