"""Per-tensor state of a stateful compressor, kept in one documented object.

Horovod calls ``compress(tensor)`` without a name, so the frontends identify a
gradient by its *slot key*: the parameter's name where the calling Horovod code shows
it (PyTorch, :func:`~horovod_sparse.horovod_frames.caller_gradient`), else its position
in the step's sequence of ``compress`` calls (PyTorch) or in the traced graph
(TensorFlow). A slot remembers its tensor's shape and dtype so that a change of order
is caught (``ValueError``) rather than feeding one tensor's residual into another.

A step commits each gradient's state in ``decompress``, once its reduced payload is finite,
and is *settled* when the next step begins (or the state is saved or loaded): if any gradient
of it overflowed (a loss scaler's overflow: :mod:`horovod_sparse.nonfinite`), the gradients
that committed are rolled back, so the whole step leaves no trace, as the scaler skips it
whole. :attr:`Slot.outcome` records what the step not yet settled did to each slot.
"""
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Tuple

#: :attr:`Slot.outcome` values: the slot took no part in the step not yet settled, committed
#: in it (rolled back if another gradient of the step overflowed), or declined it (overflow)
NO_OUTCOME, COMMITTED, OVERFLOWED = 0, 1, 2


@dataclass
class Slot:
    """State of one gradient tensor.

    Attributes:
        key: the slot key (an int position, or a user-given name).
        stream: an int that tells this tensor apart from the step's other tensors
            in random draws; equal on all ranks.
        shape: the gradient's shape.
        dtype: the gradient's dtype name.
        residual: error-feedback memory, a flat tensor of the gradient's dtype holding
            what was accumulated but not yet sent (``None`` until first used).
        step: how many steps this slot has committed (int, or a TensorFlow variable inside
            graphs); it seeds the shared random indices, so a step that overflowed (not
            committed, :mod:`horovod_sparse.nonfinite`) leaves it as it was.
        spare: after a commit, the residual before it (kept to roll the step back until it
            is settled); then the buffer the next step's ``grad + residual`` is written into
            (PyTorch), swapped with the residual on commit. None until the first commit (and
            without error feedback); a ``tf.Variable`` inside TensorFlow graphs.
        outcome: :data:`NO_OUTCOME`, :data:`COMMITTED` or :data:`OVERFLOWED`: what the step
            not yet settled did to this slot (an int, or a TensorFlow variable).
        wire: the buffer the gradient's payload is cast into for Horovod's allreduce (``fp16``:
            float16), reused every step (PyTorch; None until first used, and elsewhere). Horovod
            reduces it in place and ``decompress`` reads it before the next ``compress``
            overwrites it; it is never returned as a result. Not saved: it holds no state.
        payload_nbytes: bytes this rank hands to the wire for this tensor per step.
        dense_nbytes: bytes of the uncompressed gradient.
    """
    key: Hashable
    stream: int
    shape: Tuple[int, ...]
    dtype: str
    residual: Any = None
    step: Any = 0
    spare: Any = None
    outcome: Any = NO_OUTCOME
    wire: Any = None
    payload_nbytes: int = 0
    dense_nbytes: int = 0


@dataclass
class CompressorState:
    """All slots of one compressor instance, in creation order.

    Use one compressor instance per optimizer: the slots describe that optimizer's
    gradients. ``state_dict``/``load_state_dict`` (on the frontends) save and restore
    the residuals and step counters as numpy arrays and ints.
    """
    slots: Dict[Hashable, Slot] = field(default_factory=dict)

    def get(self, key, shape, dtype, replace=False):
        """The slot for ``key``, created on first use; checks shape and dtype (or, with
        ``replace``, starts a new slot where they changed: for stateless compressors)."""
        slot = self.slots.get(key)
        if slot is not None and replace and (slot.shape != tuple(shape) or slot.dtype != dtype):
            slot = None
        if slot is None:
            slot = Slot(key=key, stream=self.slots[key].stream if key in self.slots else self._stream(key),
                        shape=tuple(shape), dtype=dtype)
            self.slots[key] = slot
        elif slot.shape != tuple(shape) or slot.dtype != dtype:
            raise ValueError(
                f"gradient slot {key!r} was {slot.dtype}{list(slot.shape)} and is now "
                f"{dtype}{list(shape)}: the order of gradients changed between steps, or one "
                "compressor instance is shared by two optimizers (use one instance per optimizer)")
        return slot

    def _stream(self, key):
        # A named slot's stream follows from its name: ranks may create slots in different
        # orders (Horovod reduces gradients missing from the backward pass in set order).
        return zlib.crc32(key.encode()) if isinstance(key, str) else len(self.slots)

    @property
    def payload_bytes_per_step(self):
        """Bytes this rank sends into the allreduce per step (before the collective's own factor)."""
        return sum(s.payload_nbytes for s in self.slots.values())

    @property
    def dense_bytes_per_step(self):
        """Bytes the uncompressed gradients of one step would take."""
        return sum(s.dense_nbytes for s in self.slots.values())
