"""A traced TensorFlow step through ``hvd.DistributedGradientTape`` makes TensorFlow say nothing
about this package: trace-time Python (mpi4py calls, the walk over Horovod's frames) must not go
through AutoGraph, which cannot convert a C method and warns "AutoGraph could not transform
<bound method Comm.Get_size ...> ... Please report this to the TensorFlow team".

Fresh processes under ``mpirun -np 2`` (Horovod skips the allreduce on one rank, and AutoGraph
warns once per function and process): one compressor of each kind, in-band and out-of-band,
and the out-of-band schedules' other traces (per Horovod call; arrival and collecting calls)."""
import os
import subprocess
import sys

import pytest

SPECS = ["fp16", "randomk:density=0.1", "topk:density=0.05", "qsgd", "powersgd", "fft",
         "topk:density=0.05,schedule=wfbp", "topk:density=0.05,schedule=mgwfbp"]

PROGRAM = r'''
import os, sys
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
import horovod.tensorflow as hvd
import horovod_sparse.tensorflow as hvds

hvd.init()
for spec in sys.argv[1:]:
    compression = hvds.Compression.from_spec(spec)
    model = tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64), tf.keras.layers.Dense(4)])
    opt = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(2):
        step(tf.ones((8, 32)), tf.zeros((8, 4)))
    print(f"rank {hvd.rank()} traced {spec}", flush=True)
'''


@pytest.mark.timeout(300)
def test_a_traced_step_logs_no_autograph_warning(tmp_path):
    program = tmp_path / "traced_step.py"
    program.write_text(PROGRAM)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
         sys.executable, str(program), *SPECS],
        capture_output=True, text=True, timeout=280, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    for rank in (0, 1):
        for spec in SPECS:
            assert f"rank {rank} traced {spec}" in output, output[-4000:]
    assert "AutoGraph could not transform" not in output, output[-4000:]
    assert "Please report this to the TensorFlow team" not in output, output[-4000:]
