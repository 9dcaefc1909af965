"""Array operations: the small vocabularies the compressors' math is written in.

Two of them, for two kinds of compressor:

* :class:`~horovod_sparse.ops.base.ArrayOps`, for the compressors carried by Horovod's
  own allreduce (:mod:`horovod_sparse.compressors`): each is written once against its
  methods, and the three implementations (``numpy_ops``, ``torch_ops``, ``tf_ops``) make
  the same math run in each framework. numpy is the reference: tests compare the
  frameworks against it. The torch and TensorFlow implementations live in their own
  modules so that importing one framework's frontend never imports the other framework.
* functions over numpy arrays and torch tensors, for the out-of-band pipelines, one topic
  a module: ``namespace`` (which library and device), ``views`` (zero-copy views),
  ``kernels`` (in-place arithmetic), ``indices``, ``magnitude`` (magnitude keys), ``host``
  (crossing to mpi4py, counted).

Example::

    from horovod_sparse.ops import NumpyOps
    NumpyOps().gather(np.arange(5.0), np.array([1, 3]))   # array([1., 3.])
"""
from horovod_sparse.ops.base import ArrayOps, random_indices
from horovod_sparse.ops.numpy_ops import NumpyOps

__all__ = ["ArrayOps", "NumpyOps", "random_indices"]
