"""The numpy frontend: the reference implementation tests compare the frameworks with.

It is not a Horovod compressor (Horovod has no numpy frontend); it runs the same math
with explicit slot keys, so a test can replay exactly what a rank did.
"""
from horovod_sparse.in_band import InBandCompressorBase
from horovod_sparse.ops.numpy_ops import NumpyOps


class ReferenceCompressor(InBandCompressorBase):
    """Reference compressor: ``compress(array, key)`` with an explicit gradient key."""

    ops = NumpyOps()

    def compress(self, array, key):
        return self.compress_slot(array, key)

