"""``Compression.auto``: which gradients to compress and how, decided from measurements
(:mod:`horovod_sparse.auto.decide`; the PyTorch runtime is :mod:`horovod_sparse.torch.auto`)."""
