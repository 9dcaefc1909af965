"""The benchmarks' models: small PyTorch networks the step benchmark
(:mod:`horovod_sparse.bench.step`) times and ``horovod-sparse profile`` profiles
(:mod:`horovod_sparse.whatif.models`), so that both describe the same network; and their
Keras twins (:func:`build_keras_model`: the same layers and widths, the same parameter
count and tensors) for the step benchmark's TensorFlow side.

Importing this module imports only the standard library: torch is imported by
:func:`build_model`, TensorFlow by :func:`build_keras_model`, so a benchmark can list the
models without either.

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


def _widths(name: str):
    """Layer widths of the MLP ``name`` (input first), or None for a model of another kind."""
    return {"mlp5": [4096, 2048, 2048, 2048, 2048, 4096], "mlp30": [256] * 31}.get(name)


def build_model(name: str):
    """(model, input shape without batch, output features) of the model ``name`` of :data:`MODELS`.

    Example: ``build_model("cnn")[1:] == ((3, 32, 32), 10)``.
    """
    from torch import nn
    widths = _widths(name)
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, (3, 32, 32), 10
    if widths is None:
        raise ValueError(f"unknown model {name!r}; have {sorted(MODELS)}")
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers), (widths[0],), widths[-1]


def build_keras_model(name: str):
    """(Keras model, input shape without batch, output features) of the model ``name`` of
    :data:`MODELS`, layer for layer :func:`build_model`'s (``Dense`` for ``Linear``, ReLU
    between, none after the last), built (its variables exist) and seeded by the caller
    (``tf.keras.utils.set_random_seed``). ``cnn`` takes channels-last inputs, (32, 32, 3):
    TensorFlow's CPU convolutions run NHWC only; its parameters are the same.

    Set ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported where Horovod will train it.

    Example: ``build_keras_model("cnn")[1:] == ((32, 32, 3), 10)``.
    """
    import tensorflow as tf
    layers = tf.keras.layers
    widths = _widths(name)
    if name == "cnn":
        in_shape, stack = (32, 32, 3), [
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPool2D(2), layers.Flatten(),
            layers.Dense(256, activation="relu"), layers.Dense(10)]
    elif widths is None:
        raise ValueError(f"unknown model {name!r}; have {sorted(MODELS)}")
    else:
        in_shape = (widths[0],)
        stack = [layers.Dense(b, activation="relu" if i < len(widths) - 2 else None)
                 for i, b in enumerate(widths[1:])]
    model = tf.keras.Sequential([tf.keras.Input(in_shape)] + stack)
    return model, in_shape, model.output_shape[-1]
