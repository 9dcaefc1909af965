"""Model factories for ``horovod-sparse profile --model``: the step benchmark's models
(:mod:`horovod_sparse.models`), so that a profile and a measured step describe the same
network, with its random inputs and MSE loss.

    horovod-sparse profile --model horovod_sparse.whatif.models:mlp5 --batch 16 -o mlp5.json

Each factory returns ``(model, make_batch, loss_fn)``; ``make_batch(batch)`` draws
``(x, y)`` from a fixed seed.
"""
from horovod_sparse.models import MODELS, build_model


def _factory(name):
    def factory():
        import torch
        torch.manual_seed(0)
        model, in_shape, out_features = build_model(name)

        def make_batch(batch):
            gen = torch.Generator().manual_seed(1000)
            return (torch.randn((batch,) + tuple(in_shape), generator=gen),
                    torch.randn(batch, out_features, generator=gen))
        return model, make_batch, torch.nn.MSELoss()
    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = f"The step benchmark's ``{name}`` (see horovod_sparse.models.MODELS)."
    return factory


mlp5 = _factory("mlp5")
mlp30 = _factory("mlp30")
cnn = _factory("cnn")


def batch_of(name):
    """The batch size the step benchmark uses for ``name``.

    Example: ``batch_of("mlp5") == 16``.
    """
    return MODELS[name][1]
