"""The step benchmark's TensorFlow side: ``python -m horovod_sparse.bench.step --framework
tensorflow`` times the training step through ``hvd.DistributedGradientTape`` inside one
``tf.function``, for every compressor side by side with Horovod's dense:

    mpirun -np 2 python -m horovod_sparse.bench.step --framework tensorflow --models mlp5 \\
        --compressors dense hvd-fp16 topk:density=0.01 --out results/step-tf.jsonl

The driver (arguments, rounds, records, watchdog, the warm-up / timed loop, maxima over
ranks, the parameter hash) is :class:`~horovod_sparse.bench.step.StepBench`'s, whose
``TFBench`` hands this module's :class:`TFRunner` what only TensorFlow knows (this module
does not import the driver: the driver imports it):

- the models of :mod:`horovod_sparse.models` as Keras models with the same layers
  (:func:`~horovod_sparse.models.build_keras_model`; the real workloads are PyTorch only),
  seeded alike on every rank and then ``hvd.broadcast_variables``; random data drawn per rank
  with seed + 1000 * (rank + 1), as in PyTorch (numpy's generator, not torch's: other
  numbers, the same distribution); MSE loss; ``tf.keras.optimizers.SGD(lr)``;
- one traced step: forward under ``tf.GradientTape``, ``hvd.DistributedGradientTape(tape,
  compression=..., groups=...)``, its gradient, ``apply_gradients``. There is no fwd+bwd /
  opt.step split (the exchange runs inside the one traced function), so a record's
  ``fwd_bwd_ms`` and ``step_ms`` are None and ``total_ms`` is the whole step, timed as
  ``loss = step(x, y); loss.numpy()`` after the driver's barrier. Each run traces its own
  step once (TensorFlow's warning about retracing counts the runs' traces: expected);
- the compute floor: the same step with a plain ``tf.GradientTape`` (no Horovod);
- one thread per rank (intra- and inter-op, set before any op runs; recorded as
  ``intra_op_threads`` and ``inter_op_threads``), ``--tf-groups`` recorded as ``tf_groups``;
- the memory bound: one numpy copy of a float32 buffer as large as the model.

Importing this module imports only the standard library: TensorFlow, Horovod and numpy are
imported when a :class:`TFRunner` starts (``TF_USE_LEGACY_KERAS=1`` set first: Horovod 0.28
needs Keras 2).
"""
from __future__ import annotations

import os
import time

from horovod_sparse.models import MODELS, build_keras_model

#: TensorFlow's intra- and inter-op threads per rank: one, as PyTorch's ranks run with one
#: (2 ranks on 2 cores, nothing else).
TF_THREADS = 1


def random_batch(in_shape, out_features, batch, seed):
    """(x, y) float32 numpy arrays of standard normal values: a batch of inputs and targets."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch,) + tuple(in_shape), dtype=np.float32)
    y = rng.standard_normal((batch, out_features), dtype=np.float32)
    return x, y


def train_step(tf, model, opt, distribute):
    """A ``tf.function`` of one SGD step on MSE: ``distribute(tape)`` wraps the gradient tape
    (``hvd.DistributedGradientTape`` for the benchmark, the identity for the compute floor)."""
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        tape = distribute(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def keras_step(tf, model, x, y, lr, compression, groups):
    """``--tf-api keras``: the model compiled with Horovod's Keras ``DistributedOptimizer``
    (plain SGD, MSE) and ``model.train_on_batch`` as the step; returns the timed step."""
    import horovod.tensorflow.keras as hvd_keras
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(lr), compression=compression, groups=groups)
    model.compile(optimizer=opt, loss="mse")

    def step():
        t0 = time.perf_counter()
        model.train_on_batch(x, y)  # returns the loss as a Python float: the step is done
        return (time.perf_counter() - t0,)
    return step


def timed(step, x, y):
    """One call of the traced ``step``, until its loss is on the host: (seconds,)."""
    t0 = time.perf_counter()
    loss = step(x, y)
    loss.numpy()
    return (time.perf_counter() - t0,)


class TFRunner:
    """TensorFlow and Horovod's TensorFlow module, started (one thread per rank, ``hvd.init()``),
    and what the step benchmark builds with them. ``args``: the benchmark's (``seed``, ``lr``,
    ``tf_groups``)."""

    def __init__(self, args):
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow: Horovod needs Keras 2
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(TF_THREADS)   # before any op runs
        tf.config.threading.set_inter_op_parallelism_threads(TF_THREADS)
        import horovod.tensorflow as hvd
        hvd.init()
        self.tf, self.hvd, self.args = tf, hvd, args

    def frontend(self):
        """horovod_sparse's TensorFlow frontend (its ``Compression``)."""
        import horovod_sparse.tensorflow as hvds
        return hvds

    def model_and_data(self, model_name, rank):
        """(model, x, y): a fresh Keras model, the same on every rank for the same seed (Keras'
        global state cleared first, so that runs do not pile up), and ``rank``'s batch."""
        tf, seed = self.tf, self.args.seed
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(seed)
        model, in_shape, out_features = build_keras_model(model_name)
        x, y = random_batch(in_shape, out_features, MODELS[model_name][1], seed + 1000 * (rank + 1))
        return model, tf.constant(x), tf.constant(y)

    def model_size(self, model_name, rank):
        """(parameters, trainable tensors) of the model."""
        model, _, _ = self.model_and_data(model_name, rank)
        return model.count_params(), len(model.trainable_variables)

    def horovod_step(self, model_name, rank, compression):
        """(step, values) of one run: ``step()`` runs and times one step of a fresh model through
        ``hvd.DistributedGradientTape(compression=..., groups=--tf-groups)``; ``values()`` are
        the model's trainable values (numpy), for the driver's hash."""
        tf, hvd = self.tf, self.hvd
        model, x, y = self.model_and_data(model_name, rank)
        hvd.broadcast_variables(model.variables, root_rank=0)
        groups = self.args.tf_groups or None   # None: Horovod's default, one request per gradient
        values = lambda: [v.numpy() for v in model.trainable_variables]  # noqa: E731
        if getattr(self.args, "tf_api", "tape") == "keras":
            return keras_step(tf, model, x, y, self.args.lr, compression, groups), values
        step = train_step(tf, model, tf.keras.optimizers.SGD(self.args.lr),
                          lambda tape: hvd.DistributedGradientTape(tape, compression=compression, groups=groups))
        return (lambda: timed(step, x, y)), values

    def local_step(self, model_name, rank):
        """The same step with a plain ``tf.GradientTape`` (no Horovod): the compute floor."""
        tf = self.tf
        model, x, y = self.model_and_data(model_name, rank)
        step = train_step(tf, model, tf.keras.optimizers.SGD(self.args.lr), lambda tape: tape)
        return lambda: timed(step, x, y)

    def copier(self, n):
        """One numpy copy of a float32 buffer of ``n`` elements."""
        import numpy as np
        src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        dst = np.empty_like(src)
        return lambda: np.copyto(dst, src)

    def fields(self):
        """What every TensorFlow record holds beside the driver's: threads, version, groups."""
        threading = self.tf.config.threading
        intra, inter = threading.get_intra_op_parallelism_threads(), threading.get_inter_op_parallelism_threads()
        return {"threads": intra, "intra_op_threads": intra, "inter_op_threads": inter,
                "tensorflow": self.tf.__version__, "tf_groups": self.args.tf_groups,
                "tf_api": getattr(self.args, "tf_api", "tape")}
