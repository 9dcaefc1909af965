"""One bf16 step, TensorFlow or PyTorch, with the time of the pipeline's step and of its MPI calls
(docs/results/performance.md, TensorFlow, the bf16 miss at 1 Gbit/s): mlp5's five layers without biases,
batch 16, 3 warm-up and 8 timed steps; prints rank 0's median step, median pipeline step and the
MPI calls' time per step (``CountingComm``'s collectives, timed by wrapping them).

    python scripts/netem.py --rate 1gbit -np 2 --mpirun-args="--bind-to none --mca mpi_yield_when_idle 1 \\
        -x OMPI_ALLOW_RUN_AS_ROOT -x TF_CPP_MIN_LOG_LEVEL=2 -x OMP_NUM_THREADS=1" -- \\
        $PWD/.venv/bin/python studies/bf16_steps.py tf bf16:method=allgather      # or: torch
"""
import os, sys, time, statistics
os.environ["TF_USE_LEGACY_KERAS"]="1"
fw = sys.argv[1]; spec = sys.argv[2]
import horovod_sparse.quantize.pipeline as qp
times = []
orig = qp.QuantizedPipeline.step
def timed(self, grad, tag=0):
    t = time.perf_counter(); r = orig(self, grad, tag); times.append(time.perf_counter() - t); return r
qp.QuantizedPipeline.step = timed
import horovod_sparse.exchange.comm as cm
mpi = []
for name in ("allgatherv", "alltoallv", "allgather", "allreduce"):
    f = getattr(cm.CountingComm, name)
    def wrap(f=f):
        def g(self, *a, **k):
            t = time.perf_counter(); r = f(self, *a, **k); mpi.append(time.perf_counter() - t); return r
        return g
    setattr(cm.CountingComm, name, wrap())
W = 4096; H = 2048
if fw == "tf":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1); tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd, horovod_sparse.tensorflow as hvds
    hvd.init()
    comp = hvds.Compression.from_spec(spec)
    ws = [tf.Variable(tf.random.normal((a, b), seed=i) * 0.01) for i, (a, b) in enumerate([(W, H), (H, H), (H, H), (H, H), (H, W)])]
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in ws: h = tf.nn.relu(h @ w)
            loss = tf.reduce_mean(h * h)
        g = hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, ws)
        for w, gg in zip(ws, g): w.assign_sub(0.001 * gg)
        return loss
    x = tf.random.normal((16, W))
    run = lambda: step(x).numpy()
    barrier = lambda: hvd.allreduce(tf.zeros(1), name="b")
else:
    import torch, horovod.torch as hvd, horovod_sparse.torch as hvds
    torch.set_num_threads(1); hvd.init()
    comp = hvds.Compression.from_spec(spec)
    model = torch.nn.Sequential(*[m for a, b in [(W, H), (H, H), (H, H), (H, H), (H, W)] for m in (torch.nn.Linear(a, b, bias=False), torch.nn.ReLU())])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001), named_parameters=model.named_parameters(), compression=comp)
    x = torch.randn(16, W)
    def run():
        opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    barrier = lambda: hvd.allreduce(torch.zeros(1), name="b")
for _ in range(3): run()
times.clear(); mpi.clear(); st = []
for _ in range(8):
    barrier(); t = time.perf_counter(); run(); st.append(time.perf_counter() - t)
if hvd.rank() == 0:
    print(fw, spec, "step %.0f ms, pipeline.step %.0f ms, mpi calls per step %.0f ms" % (1e3 * statistics.median(st), 1e3 * statistics.median(times), 1e3 * sum(mpi) / 8), flush=True)
