"""Array operations: the small vocabulary the compressors' math is written in.

Each compressor in :mod:`horovod_sparse.compressors` is written once against the
methods of :class:`~horovod_sparse.ops.base.ArrayOps`; the three implementations
(numpy, torch, TensorFlow) make the same math run in each framework. numpy is the
reference: tests compare the frameworks against it.

The torch and TensorFlow implementations live in their own modules so that importing
one framework's frontend never imports the other framework.
"""
from horovod_sparse.ops.base import ArrayOps, random_indices
from horovod_sparse.ops.numpy_ops import NumpyOps

__all__ = ["ArrayOps", "NumpyOps", "random_indices"]
