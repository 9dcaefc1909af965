"""``none`` and ``fp16``: compressors that only change the dtype on the wire."""
from horovod_sparse.compressors.base import WIRE_DTYPE, Compressor
from horovod_sparse.registry import register


class CastCompressor(Compressor):
    """Casts floating gradients to ``wire_dtypes[dtype]`` for the allreduce and back after.

    Horovod reduces the cast payload, which is linear, so any dtype Horovod's allreduce
    accepts works. Dtypes not in ``wire_dtypes`` (integers among them) pass untouched.
    """

    #: gradient dtype name -> dtype name on the wire
    wire_dtypes = WIRE_DTYPE

    def compress(self, ops, tensor, slot):
        dtype = ops.dtype_name(tensor)
        wire = self.wire_dtypes.get(dtype)
        return (ops.cast(tensor, wire) if wire else tensor), dtype

    def decompress(self, ops, payload, ctx):
        if ctx is None or ops.dtype_name(payload) == ctx:
            return payload
        return ops.cast(payload, ctx)


@register
class NoneCompressor(CastCompressor):
    """No compression: the baseline. Only bfloat16 changes: it travels as float32, since
    Horovod's PyTorch allreduce rejects bfloat16."""

    name = "none"


@register
class FP16Compressor(CastCompressor):
    """float32/float64 gradients travel as float16 (half the bytes of float32), like
    Horovod's own ``Compression.fp16``. float16 passes as it is; bfloat16 travels as
    float32 (float16's range is far narrower than bfloat16's). Values beyond float16's
    range (|x| > 65504) become inf, as with Horovod's."""

    name = "fp16"
    wire_dtypes = dict(WIRE_DTYPE, float32="float16", float64="float16")
