"""The compressors' math, written once over :class:`horovod_sparse.ops.ArrayOps`.

A compressor here is framework-free: the frontends (:mod:`horovod_sparse.torch`,
:mod:`horovod_sparse.tensorflow`) wrap it in a real Horovod ``Compressor`` subclass
and supply the ops and the per-tensor state. One module per family: ``cast`` (none,
fp16), ``randomk``, ``sparsifiers`` (top-k and its kin), ``quantizers``, ``powersgd``,
``fft``; :data:`horovod_sparse.registry.COMPRESSORS` names each class, and importing this
package imports none of them (a family pulls in its exchanges, and with them mpi4py).

Example::

    from horovod_sparse.compressors.sparsifiers import TopKCompressor
    TopKCompressor(density=0.01).params["density"]   # 0.01
"""
from horovod_sparse.compressors.base import Compressor, OutOfBandCompressor

__all__ = ["Compressor", "OutOfBandCompressor"]
