"""Per-tensor state of a stateful compressor, kept in one documented object.

Horovod calls ``compress(tensor)`` without a name, so the frontends identify a
gradient by its *slot key*: the parameter's name where the calling Horovod code shows
it (PyTorch, :func:`~horovod_sparse.horovod_frames.caller_gradient`), else its position
in the step's sequence of ``compress`` calls (PyTorch) or in the traced graph
(TensorFlow). A slot remembers its tensor's shape and dtype so that a change of order
is caught (``ValueError``) rather than feeding one tensor's residual into another.
"""
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Tuple


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
        step: how many times this slot has been compressed (int, or a TensorFlow
            variable inside graphs).
        payload_nbytes: bytes this rank hands to the wire for this tensor per step.
        dense_nbytes: bytes of the uncompressed gradient.
    """
    key: Hashable
    stream: int
    shape: Tuple[int, ...]
    dtype: str
    residual: Any = None
    step: Any = 0
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
