"""horovod_sparse: gradient compressors for Horovod, and a sparse allreduce over mpi4py.

Framework frontends (each imports only its own framework):

* :mod:`horovod_sparse.torch` — ``Compression.<name>(...)`` for ``hvd.DistributedOptimizer``;
* :mod:`horovod_sparse.tensorflow` — the same for ``hvd.DistributedGradientTape`` and the
  Keras ``DistributedOptimizer``.

:func:`available` lists the compressors; :func:`create` builds one's framework-free
math from a spec string such as ``"randomk:density=0.01"``.
"""
from horovod_sparse.registry import available, create

__version__ = "0.1.0"
__all__ = ["available", "create", "__version__"]
