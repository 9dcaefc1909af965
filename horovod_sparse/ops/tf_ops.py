"""TensorFlow implementation of :class:`ArrayOps`.

Horovod calls TensorFlow compressors while tracing a ``tf.function``, so every op here
is graph-safe: residuals and step counters are ``tf.Variable``s (created outside the
trace with ``tf.init_scope``), and the shared random-index generator runs through
``tf.numpy_function`` with the step counter as its input.
"""
import numpy as np
import tensorflow as tf

from horovod_sparse.nonfinite import raise_with_hint
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.ops.base import ArrayOps, random_indices
from horovod_sparse.slots import COMMITTED, NO_OUTCOME, OVERFLOWED


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

    # A step commits only once its reduced payload is finite, and is settled when the next one
    # begins (horovod_sparse.slots). Eagerly the flags are Python bools and the base class's
    # code runs on the variables; in a graph they are bool tensors, traced with tf.where / tf.cond.
    def all_finite(self, t):
        flat = tf.reshape(t, [-1])
        if tf.executing_eagerly():
            return super().all_finite(flat)
        # the sum is finite only if every element is; the exact check runs where it is not
        return tf.cond(tf.math.is_finite(tf.reduce_sum(flat)), lambda: tf.constant(True),
                       lambda: tf.reduce_all(tf.math.is_finite(flat)))

    def nan_unless(self, flag, t):
        if isinstance(flag, bool):
            return super().nan_unless(flag, t)
        return tf.where(flag, t, tf.constant(float("nan"), t.dtype))

    def fill_nan_(self, t):
        return tf.fill(tf.shape(t), tf.constant(float("nan"), t.dtype))

    def commit_if(self, flag, slot, residual, result):
        if isinstance(flag, bool):
            return super().commit_if(flag, slot, residual, result)

        def commit():
            updates = [slot.step.assign_add(1, read_value=False),
                       slot.outcome.assign(COMMITTED, read_value=False)]
            if residual is not None:  # the residual before it is kept until the step is settled
                kept = slot.spare.assign(slot.residual.read_value(), read_value=False)
                with tf.control_dependencies([kept]):
                    updates.append(slot.residual.assign(residual, read_value=False))
            with tf.control_dependencies(updates):
                return tf.constant(True)

        def decline():
            with tf.control_dependencies([slot.outcome.assign(OVERFLOWED, read_value=False)]):
                return tf.constant(False)

        committed = tf.cond(flag, commit, decline)
        with tf.control_dependencies([committed]):  # a TF1 graph runs only what a fetch needs
            return tf.identity(result)

    def settle(self, slots):
        if tf.executing_eagerly():
            return super().settle(slots)
        # traced in the graph around Horovod's per-gradient tf.conds, before them: each reads
        # only its own slot's variables, so the gradients' allreduces stay independent
        if not slots:
            return tf.constant(False)
        outcomes = [slot.outcome.read_value() for slot in slots]
        overflowed = tf.reduce_any(tf.equal(tf.stack(outcomes), OVERFLOWED))

        def roll_back_committed():
            rolled = [tf.cond(tf.equal(outcome, COMMITTED), lambda slot=slot: self._traced_roll_back(slot),
                              lambda: tf.constant(False)) for slot, outcome in zip(slots, outcomes)]
            return tf.reduce_any(tf.stack(rolled))

        rolled = tf.cond(overflowed, roll_back_committed, lambda: tf.constant(False))
        with tf.control_dependencies([rolled]):
            resets = [slot.outcome.assign(NO_OUTCOME, read_value=False) for slot in slots]
        with tf.control_dependencies(resets):
            return tf.identity(rolled)

    @staticmethod
    def _traced_roll_back(slot):
        restored = [slot.residual.assign(slot.spare.read_value(), read_value=False),
                    slot.step.assign_sub(1, read_value=False)]
        with tf.control_dependencies(restored):
            return tf.constant(True)

    def roll_back(self, slot):
        slot.residual.assign(slot.spare)
        slot.step.assign_sub(1)

    def read_outcome(self, slot):
        return int(slot.outcome.numpy())

    def write_outcome(self, slot, outcome):
        slot.outcome.assign(outcome)

    def raise_unless_finite(self, flag, message, result):
        if isinstance(flag, bool):
            return super().raise_unless_finite(flag, message, result)

        def fail(_):  # runs only where the payload is not finite
            raise_with_hint(NonFiniteGradientError(message))

        # the error is raised by a host call on the non-finite branch only: TensorFlow's
        # InvalidArgumentError then carries its type and message as they are
        check = tf.cond(flag, lambda: tf.constant(True),
                        lambda: tf.numpy_function(fail, [flag], tf.bool, stateful=True))
        with tf.control_dependencies([check]):
            return tf.identity(result)

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
            # the residual before the last commit, and what the step not yet settled did
            slot.spare = tf.Variable(tf.zeros_like(residual), trainable=False, name=f"spare_{slot.stream}")
            slot.outcome = tf.Variable(NO_OUTCOME, dtype=tf.int32, trainable=False, name=f"outcome_{slot.stream}")

    def load_slot(self, slot, residual, step):
        self.check_saved_residual(slot, residual)
        slot.residual.assign(residual)
        slot.step.assign(int(step))
        slot.outcome.assign(NO_OUTCOME)

    def read_residual(self, slot):
        return slot.residual.read_value()

    def write_residual(self, slot, value):
        slot.spare.assign(slot.residual)  # kept until the step is settled (roll_back)
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
