"""The compressors' math, written once over :class:`horovod_sparse.ops.ArrayOps`.

A compressor here is framework-free: the frontends (:mod:`horovod_sparse.torch`,
:mod:`horovod_sparse.tensorflow`) wrap it in a real Horovod ``Compressor`` subclass
and supply the ops and the per-tensor state. Importing this package registers every
compressor in :mod:`horovod_sparse.registry`.
"""
from horovod_sparse.compressors.base import Compressor
from horovod_sparse.compressors.cast import FP16Compressor, NoneCompressor
from horovod_sparse.compressors.randomk import RandomKCompressor
from horovod_sparse.compressors import fft, powersgd, quantizers  # noqa: F401  (registers them)
from horovod_sparse.compressors.sparsifiers import (DGCCompressor, GaussianKCompressor, GTopKCompressor,
                                                    OkTopKCompressor, ThresholdCompressor, TopKCompressor)

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "RandomKCompressor", "TopKCompressor",
           "OkTopKCompressor", "GaussianKCompressor", "ThresholdCompressor", "DGCCompressor",
           "GTopKCompressor"]
