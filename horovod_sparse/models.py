"""The benchmarks' models: small PyTorch networks the step benchmark
(:mod:`horovod_sparse.bench.step`) times and ``horovod-sparse profile`` profiles
(:mod:`horovod_sparse.whatif.models`), so that both describe the same network.

Importing this module imports only the standard library: torch is imported by
:func:`build_model`, so a benchmark can list the models without it.

Example::

    model, in_shape, out_features = build_model("mlp30")   # in_shape (256,), 256 outputs
    batch = MODELS["mlp30"][1]                              # 32
"""

#: name -> (description, batch); the layers are built by :func:`build_model`.
MODELS = {
    "mlp5": ("5 Linear 4096-2048-2048-2048-2048-4096, ReLU, MSE", 16),
    "mlp30": ("30 Linear 256-256, ReLU, MSE", 32),
    "cnn": ("4 Conv3x3 (32,32,64,64) + 2 Linear (4096-256-10) on 3x32x32, MSE", 32),
}


def build_model(name: str):
    """(model, input shape without batch, output features) of the model ``name`` of :data:`MODELS`.

    Example: ``build_model("cnn")[1:] == ((3, 32, 32), 10)``.
    """
    from torch import nn
    if name == "mlp5":
        widths = [4096, 2048, 2048, 2048, 2048, 4096]
    elif name == "mlp30":
        widths = [256] * 31
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, (3, 32, 32), 10
    else:
        raise ValueError(f"unknown model {name!r}; have {sorted(MODELS)}")
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers), (widths[0],), widths[-1]
