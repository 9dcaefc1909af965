"""PyTorch frontend: Horovod compressors for ``hvd.DistributedOptimizer``.

    import horovod.torch as hvd
    import horovod_sparse.torch as hvds

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvds.Compression.randomk(density=0.01))

Imports PyTorch (and Horovod's PyTorch ops) only.
"""
from horovod_sparse.torch.adamw import AdamW
from horovod_sparse.torch.compression import Compression, TorchCompressor
from horovod_sparse.torch.auto import TorchAutoCompressor
from horovod_sparse.torch.out_of_band import TorchOutOfBandCompressor
from horovod_sparse.torch import elastic

elastic.register()  # hvd.elastic.TorchState(..., compression=compression) carries its state

__all__ = ["AdamW", "Compression", "TorchAutoCompressor", "TorchCompressor", "TorchOutOfBandCompressor"]
