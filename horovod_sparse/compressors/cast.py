"""``none`` and ``fp16``: compressors that only change the dtype on the wire.

With a slot (the in-band frontends), the cast goes into the slot's wire buffer, reused every
step, and the reduced payload is cast back into the gradient itself where the frontend allows
it (``ctx.gradient``): the round trip is then two conversions at memory speed instead of two
fresh allocations (PyTorch: :mod:`horovod_sparse.ops.torch_ops`). Same bits either way.
"""
from dataclasses import dataclass, replace
from typing import Any

from horovod_sparse.compressors.base import WIRE_DTYPE, Compressor


class CastCompressor(Compressor):
    """Casts floating gradients to ``wire_dtypes[dtype]`` for the allreduce and back after.

    Horovod reduces the cast payload, which is linear, so any dtype Horovod's allreduce
    accepts works. Dtypes not in ``wire_dtypes`` (integers among them) pass untouched.

    Stateless, so a loss scaler's overflow needs nothing here: an inf or NaN on any rank makes
    the reduced payload non-finite on every rank, as with Horovod's own compressors (fp16 also
    turns |x| > 65504 into inf). The frontends' ``nonfinite="raise"`` checks the reduced payload
    (:class:`~horovod_sparse.in_band.InBandCompressorBase`).
    """

    #: gradient dtype name -> dtype name on the wire
    wire_dtypes = WIRE_DTYPE

    def compress(self, ops, tensor, slot, in_place=False):
        dtype = ops.dtype_name(tensor)
        # without a slot (the out-of-band frontends' small tensors) no wire buffer is kept
        return to_wire(ops, tensor, self.wire_dtypes, slot), CastContext(dtype, tensor if in_place else None)

    def decompress(self, ops, payload, ctx):
        return payload if ctx is None else from_wire(ops, payload, ctx.dtype, ctx.gradient)


@dataclass(frozen=True)
class CastContext:
    """What :meth:`CastCompressor.compress` hands to its ``decompress`` (not a tuple: callers tell
    random-k's context, a tuple of the indices first, from the others by that)."""
    dtype: str       # the gradient's dtype name
    gradient: Any    # the gradient, free to overwrite with the result (None: return a new tensor)

    def _replace(self, **changes):
        """A copy with ``changes``, as a NamedTuple's ``_replace``."""
        return replace(self, **changes)


class NoneCompressor(CastCompressor):
    """No compression: the baseline. Only bfloat16 changes: it travels as float32, since
    Horovod's PyTorch allreduce rejects bfloat16."""

    name = "none"


class FP16Compressor(CastCompressor):
    """float32/float64 gradients travel as float16 (half the bytes of float32), like
    Horovod's own ``Compression.fp16``. float16 passes as it is; bfloat16 travels as
    float32 (float16's range is far narrower than bfloat16's). Values beyond float16's
    range (|x| > 65504) become inf, as with Horovod's."""

    name = "fp16"
    wire_dtypes = dict(WIRE_DTYPE, float32="float16", float64="float16")


def to_wire(ops, tensor, wire_dtypes=WIRE_DTYPE, slot=None):
    """``tensor`` cast to its dtype on the wire, ``wire_dtypes[its dtype]`` (as it is when
    ``wire_dtypes`` names none), into ``slot``'s wire buffer where the framework can
    (:meth:`~horovod_sparse.ops.base.ArrayOps.cast_to_wire`). Example: ``to_wire(ops,
    bf16_tensor)`` is float32."""
    wire = wire_dtypes.get(ops.dtype_name(tensor))
    return ops.cast_to_wire(tensor, wire, slot) if wire else tensor


def from_wire(ops, tensor, dtype, out=None):
    """A reduced ``tensor`` back in the gradient's ``dtype`` (as it is when already so), written
    into ``out`` (the gradient) where the framework can
    (:meth:`~horovod_sparse.ops.base.ArrayOps.cast_back`)."""
    return tensor if ops.dtype_name(tensor) == dtype else ops.cast_back(tensor, dtype, out)
