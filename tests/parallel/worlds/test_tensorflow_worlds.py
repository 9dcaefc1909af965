"""TensorFlow through hvd.DistributedGradientTape, with Horovod on a part of COMM_WORLD: the
out-of-band exchanges run among Horovod's world, mapped at trace time by Horovod's own
allgather (run eagerly, out of the trace).

``dense`` and ``topk:density=1.0`` equal Horovod's own dense run of the same steps; top-k at
density 0.01 equals the numpy reference of its pipeline over the world; replicas of each world
end bitwise identical. Over Horovod's own collectives (a Gloo launch's transport, simulated;
tests/parallel/gloo runs a real one) the steps give bitwise what they give over mpi4py.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_sparse  # noqa: E402
import horovod_sparse.tensorflow as hvds  # noqa: E402
from horovod_sparse.horovod_collectives import HorovodCollectives  # noqa: E402
from horovod_sparse.layout import GradientLayout  # noqa: E402
from horovod_sparse.world import horovod_world  # noqa: E402
from world_scenarios import CW, assert_horovod_equal, assert_identical, init_world  # noqa: E402

WIDTH = 40
STEPS = 3


@pytest.fixture(scope="module", params=["split 2+2", "ranks [3,1,2]+[0]"])
def scenario(request):
    return request.param


@pytest.fixture
def world(scenario):
    """Horovod (TensorFlow) initialised on the scenario's world, unless it already is."""
    return init_world(hvd, scenario)


def make_variables():
    rng = np.random.default_rng(7)  # the same on every rank
    return [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.1, name=name)
            for name, shape in (("w1", (WIDTH, WIDTH)), ("b1", (WIDTH,)), ("w2", (WIDTH, WIDTH)))]


def data(step):
    """Different on every COMM_WORLD rank, so that a sum over another world differs too."""
    rng = np.random.default_rng(1000 * CW.Get_rank() + step)
    return (tf.constant(rng.standard_normal((8, WIDTH)).astype(np.float32)),
            tf.constant(rng.standard_normal((8, WIDTH)).astype(np.float32)))


def loss_of(variables, x, y):
    w1, b1, w2 = variables
    return tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) - y))


def run(compression, steps=STEPS, **tape_options):
    """Steps of plain SGD through DistributedGradientTape (given ``tape_options``) in a
    tf.function: (the gradients each step applied, this rank's local gradients of each step,
    final parameters)."""
    variables = make_variables()

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(variables, x, y)
        grads = hvd.DistributedGradientTape(tape, compression=compression, **tape_options).gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.05 * g)
        return grads

    applied, local = [], []
    for step in range(steps):
        x, y = data(step)
        with tf.GradientTape() as tape:
            loss = loss_of(variables, x, y)
        local.append([g.numpy() for g in tape.gradient(loss, variables)])
        applied.append([g.numpy() for g in step_fn(x, y)])
    return applied, local, np.concatenate([v.numpy().ravel() for v in variables])


@pytest.mark.parametrize("spec", ["dense", "topk:density=1.0"])
def test_dense_sums_equal_horovods_own(spec, world):
    horovods, _, horovod_params = run(hvd.Compression.none)
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    try:
        ours, _, params = run(compression)
        assert horovod_world().Get_size() == hvd.size() == len(world.members)
        for step in range(STEPS):
            for mine, want in zip(ours[step], horovods[step]):
                assert_horovod_equal(world.comm, mine, want)
        assert_horovod_equal(world.comm, params, horovod_params)
        assert_identical(world.comm, params)
    finally:
        compression.close()


def test_topk_sums_over_its_world(world):
    spec = "topk:density=0.01"
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    shapes = [(WIDTH, WIDTH), (WIDTH,), (WIDTH, WIDTH)]
    layout = GradientLayout([(f"g{i}", shape, "float32") for i, shape in enumerate(shapes)])
    oracle = horovod_sparse.create(spec).make_pipeline(layout.n, world.comm, layout=layout)
    try:
        ours, local, params = run(compression)
        for step in range(STEPS):
            if hvd.size() == 1:  # Horovod's tape reduces nothing on one rank: the local gradients
                want = local[step]
            else:
                summed = oracle.step(layout.fuse(local[step]), tag=layout.tag)
                want = layout.split(np.asarray(summed) / np.float32(hvd.size()))
            for mine, expected in zip(ours[step], want):
                np.testing.assert_allclose(mine, np.reshape(expected, mine.shape), rtol=1e-5, atol=1e-5)
        assert_identical(world.comm, params)
    finally:
        oracle.close()
        compression.close()


def test_horovods_collectives_give_mpi4pys_sums(monkeypatch):
    """In each world of the 2+2 split (two ranks), top-k's steps over Horovod's collectives give
    bitwise the gradients and parameters they give over mpi4py: where mpi4py's world is each
    process alone (simulated, as a Gloo launch gives: the default transport picks Horovod's
    collectives), and where the transport is forced to Horovod's. (Sparse sums of varying sizes,
    gathered; dense's Allreduce is checked against Horovod's own in tests/parallel/gloo.)"""
    spec = "topk:density=0.01"
    from mpi4py import MPI

    from horovod_sparse import world as horovod_world_module
    init_world(hvd, "split 2+2")

    def trained():
        compression = hvds.Compression.from_spec(spec, dense_below=0)
        try:
            applied, _, params = run(compression)
        finally:
            compression.close()
        return [g for grads in applied for g in grads] + [params]

    over_mpi = trained()
    for transport in ("auto", "horovod"):
        horovod_world_module.forget()
        monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", transport)
        if transport == "auto":
            monkeypatch.setattr(horovod_world_module, "mpi_world", lambda: MPI.COMM_SELF)
        try:
            assert isinstance(horovod_world(), HorovodCollectives) and horovod_world().Get_size() == 2
            over_horovod = trained()
        finally:
            monkeypatch.undo()
            horovod_world_module.forget()
        for theirs, ours in zip(over_mpi, over_horovod):
            np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=transport)
