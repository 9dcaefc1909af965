"""Where Keras' extra step time goes (docs/results/performance.md, TensorFlow, the Keras bullet): the same
5-layer 2048-wide MLP trained through ``hvd.DistributedGradientTape`` in a ``tf.function`` and through
Keras ``train_on_batch`` with Horovod's Keras ``DistributedOptimizer``, each twice in one process;
prints the median step and the median time inside the compressor's host call (the
``tf.numpy_function`` of :mod:`horovod_sparse.tensorflow.bucket_exchange`, timed by wrapping it).

    mpirun -np 2 --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \\
        -x TF_USE_LEGACY_KERAS=1 .venv/bin/python studies/keras_vs_tape.py topk:density=0.01
    mpirun ... studies/keras_vs_tape.py dense        # Horovod's own allreduce
"""
import os, time, statistics, sys
os.environ["TF_USE_LEGACY_KERAS"]="1"
import numpy as np, tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1); tf.config.threading.set_inter_op_parallelism_threads(1)
import horovod.tensorflow as hvd, horovod.tensorflow.keras as hvdk
import horovod_sparse.tensorflow as hvds
import horovod_sparse.tensorflow.bucket_exchange as be
hvd.init()
inside = []
orig = be._numpy_function
def timed_nf(func, inp, Tout):
    def wrapped(*a):
        t = time.perf_counter(); r = func(*a); inside.append(time.perf_counter() - t); return r
    return orig(wrapped, inp, Tout)
be._numpy_function = timed_nf
W = 2048
def model_fn():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input((W,))] + [tf.keras.layers.Dense(W, activation="relu") for _ in range(4)] + [tf.keras.layers.Dense(W)])
x = np.random.default_rng(hvd.rank()).standard_normal((16, W)).astype(np.float32); y = np.zeros((16, W), np.float32)
spec = sys.argv[1]
def run(kind):
    comp = hvds.Compression.from_spec(spec) if spec != "dense" else hvd.Compression.none
    model = model_fn()
    if kind == "keras":
        opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.001), compression=comp)
        model.compile(opt, loss="mse")
        step = lambda: model.train_on_batch(x, y)
    else:
        opt = tf.keras.optimizers.SGD(0.001)
        @tf.function
        def tstep(xx, yy):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xx) - yy))
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            g = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(g, model.trainable_variables))
            return loss
        xt, yt = tf.constant(x), tf.constant(y)
        step = lambda: tstep(xt, yt).numpy()
    for _ in range(3): step()
    inside.clear(); ts = []
    for _ in range(15):
        hvd.allreduce(tf.zeros(1), name="barrier")
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, (statistics.median(inside) * 1e3 if inside else None), len(inside)
for kind in ("tape", "keras", "tape", "keras"):
    r = run(kind)
    if hvd.rank() == 0: print(spec, kind, "step %.1f ms, inside host call %s ms (%d calls)" % (r[0], r[1] and round(r[1], 1), r[2]), flush=True)
