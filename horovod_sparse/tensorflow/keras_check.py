"""Refuse Keras 3, with which Horovod 0.28 trains without synchronising.

Measured here: with Keras 3 as ``tf.keras``, ``horovod.tensorflow.keras.DistributedOptimizer``
+ ``model.fit`` runs without error but never allreduces (replicas drift, ``compress`` is
never called), and ``hvd.broadcast_variables`` / ``DistributedGradientTape`` fail on Keras 3
variables. With ``TF_USE_LEGACY_KERAS=1`` set before TensorFlow is imported (and tf-keras
installed), ``tf.keras`` is Keras 2 and all of it works.
"""
import os


class KerasVersionError(ImportError):
    """``tf.keras`` is Keras 3, which Horovod 0.28 silently fails to synchronise."""


def check_keras_version():
    """Raise :class:`KerasVersionError` if ``tf.keras`` is Keras 3."""
    import tensorflow as tf

    version = getattr(tf.keras, "__version__", None) or _keras_version_from_module(tf.keras)
    if version and int(version.split(".")[0]) >= 3:
        legacy = os.environ.get("TF_USE_LEGACY_KERAS")
        hint = ("TF_USE_LEGACY_KERAS is set but tf-keras is not installed: pip install tf-keras"
                if legacy in ("1", "true", "True") else
                "set TF_USE_LEGACY_KERAS=1 in the environment before TensorFlow is imported "
                "(e.g. `export TF_USE_LEGACY_KERAS=1`, or `mpirun -x TF_USE_LEGACY_KERAS=1 ...`), "
                "with tf-keras installed (pip install tf-keras)")
        raise KerasVersionError(
            f"tf.keras is Keras {version}. Horovod 0.28 does not support Keras 3: its Keras "
            "DistributedOptimizer trains without any allreduce, silently. To use horovod_sparse "
            f"with TensorFlow, {hint}.")


def _keras_version_from_module(module):
    name = getattr(module, "__name__", "")
    if name.startswith("tf_keras"):
        return "2"
    if name.startswith("keras"):
        import keras
        return keras.__version__
    return None
