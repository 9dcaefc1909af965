"""TensorFlow implementation of :class:`ArrayOps`.

Horovod calls TensorFlow compressors while tracing a ``tf.function``, so every op here
is graph-safe: residuals and step counters are ``tf.Variable``s (created outside the
trace with ``tf.init_scope``), and the shared random-index generator runs through
``tf.numpy_function`` with the step counter as its input.
"""
import numpy as np
import tensorflow as tf

from horovod_sparse.ops.base import ArrayOps, random_indices


class TFOps(ArrayOps):
    name = "tensorflow"

    def dtype_name(self, t):
        return t.dtype.name

    def shape(self, t):
        if not t.shape.is_fully_defined():
            raise ValueError(f"horovod_sparse needs gradients of static shape, got {t.shape}")
        return tuple(int(d) for d in t.shape)

    def cast(self, t, dtype_name):
        return tf.cast(t, dtype_name)

    def reshape(self, t, shape):
        return tf.reshape(t, shape)

    def zeros(self, shape, dtype_name, like=None):
        return tf.zeros(shape, dtype=dtype_name)

    def gather(self, flat, indices):
        return tf.gather(flat, indices)

    def scatter(self, indices, values, n):
        return tf.scatter_nd(indices[:, None], values, [n])

    def zero_at_(self, flat, indices):
        return tf.tensor_scatter_nd_update(flat, indices[:, None], tf.zeros_like(tf.gather(flat, indices)))

    def random_indices(self, seed, stream, step, n, k, like=None):
        if isinstance(step, int):
            return tf.constant(random_indices(seed, stream, step, n, k))
        indices = tf.numpy_function(lambda s: random_indices(seed, stream, int(s), n, k),
                                    [step], tf.int64, stateful=False)
        indices.set_shape([k])
        return indices

    # Slots hold tf.Variables so that a traced graph reads and updates them every step.
    def init_slot(self, slot, residual_dtype, like, saved=None):
        # A checkpoint's state is the variables' initial value: made once, outside the traced
        # step (an assign traced into the step would run again at every step).
        if saved is not None:
            self.check_saved_residual(slot, saved[0])
        with tf.init_scope():
            residual, step = tf.zeros([self.numel_of(slot.shape)], residual_dtype), 0
            if saved is not None:
                residual, step = tf.constant(saved[0], residual_dtype), int(saved[1])
            slot.residual = tf.Variable(residual, trainable=False, name=f"residual_{slot.stream}")
            slot.step = tf.Variable(step, dtype=tf.int64, trainable=False, name=f"step_{slot.stream}")

    def load_slot(self, slot, residual, step):
        self.check_saved_residual(slot, residual)
        slot.residual.assign(residual)
        slot.step.assign(int(step))

    def read_residual(self, slot):
        return slot.residual.read_value()

    def write_residual(self, slot, value):
        slot.residual.assign(value)

    def read_step(self, slot):
        return slot.step.read_value()

    def advance_step(self, slot):
        slot.step.assign_add(1)

    def slot_to_numpy(self, slot):
        return slot.residual.numpy(), int(slot.step.numpy())

    def to_numpy(self, t):
        return np.asarray(t)

    def from_numpy(self, a, like=None):
        return tf.convert_to_tensor(a)
