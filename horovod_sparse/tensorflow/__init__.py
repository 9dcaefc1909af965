"""TensorFlow frontend: Horovod compressors for ``hvd.DistributedGradientTape`` and
``horovod.tensorflow.keras.DistributedOptimizer``.

    import horovod.tensorflow as hvd
    import horovod_sparse.tensorflow as hvds

    tape = hvd.DistributedGradientTape(tape, compression=hvds.Compression.randomk(density=0.01))

Imports TensorFlow (and Horovod's TensorFlow ops) only. Horovod 0.28 does not work
with Keras 3, TensorFlow 2.16+'s default ``tf.keras``: importing this module then
raises :class:`KerasVersionError` (set ``TF_USE_LEGACY_KERAS=1`` with tf-keras installed).
"""
from horovod_sparse.tensorflow.keras_check import KerasVersionError, check_keras_version

check_keras_version()

from horovod_sparse.tensorflow.auto import TFAutoCompressor  # noqa: E402
from horovod_sparse.tensorflow.out_of_band import TFOutOfBandCompressor  # noqa: E402
from horovod_sparse.tensorflow.compression import Compression, TFCompressor  # noqa: E402

__all__ = ["Compression", "TFAutoCompressor", "TFCompressor", "TFOutOfBandCompressor", "KerasVersionError",
           "check_keras_version"]
