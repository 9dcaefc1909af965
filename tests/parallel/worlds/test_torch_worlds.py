"""PyTorch through the stock hvd.DistributedOptimizer, with Horovod on a part of COMM_WORLD
(``hvd.init(comm=Split)`` 2+2 and 3+1, ``hvd.init(comm=[3, 1, 2])`` beside ``[0]``): every
out-of-band compressor sums over its own Horovod world, never over COMM_WORLD.

``dense`` and ``topk:density=1.0`` must equal Horovod's own dense run of the same script; the
others equal, step by step, an independent numpy reference of the same pipeline fed this
world's local gradients and summed over the tests' own communicator of the world; the
replicas of each world end bitwise identical.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.agreement import communicator_of
from horovod_sparse.checkpoint import gather_state, scatter_state
from horovod_sparse.layout import GradientLayout
from horovod_sparse.world import forget, horovod_world
from world_scenarios import (CW, SCENARIOS, SUB_WORLDS, assert_horovod_equal, assert_identical, average,
                             init_world)

WIDTH = 40  # 40 x 40 = 1600 elements per weight: compressed, with dense_below=0
STEPS = 3
OUT_OF_BAND = sorted(name for name in horovod_sparse.available()
                     if getattr(horovod_sparse.create(name), "out_of_band", False))
SPARSE_SPECS = ["topk:density=0.01", "powersgd:rank=2", *[n for n in OUT_OF_BAND if n not in ("dense", "topk")]]


@pytest.fixture(scope="module", params=SUB_WORLDS)
def scenario(request):
    """The scenario's name: module-scoped, so that pytest runs each scenario's tests together."""
    return request.param


@pytest.fixture
def world(scenario):
    """Horovod (PyTorch) initialised on the scenario's world, unless it already is."""
    return init_world(hvd, scenario)


def three_layers():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH))


def distributed(model, compression, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   **kwargs)
    if "process_set" not in kwargs:  # the same seed everywhere: this only shows Horovod's broadcast works
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def loss_of(model, step):
    """Data that differs per COMM_WORLD rank, so that a sum over another world differs too."""
    g = torch.Generator().manual_seed(1000 * CW.Get_rank() + step)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def local_gradients(model, step):
    twin = copy.deepcopy(model)
    loss_of(twin, step).backward()
    return {name: p.grad.numpy().copy() for name, p in twin.named_parameters()}


def train_step(model, opt, step):
    """One step; returns the gradients the optimizer got, by name."""
    opt.zero_grad()
    loss_of(model, step).backward()
    opt.synchronize()
    reduced = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    with opt.skip_synchronize():
        opt.step()
    return reduced


def flat(values):
    return np.concatenate([np.asarray(v).ravel() for v in values])


def horovod_dense_run(steps=STEPS, **kwargs):
    """Horovod's own dense allreduce on the same script: (gradients per step, final parameters)."""
    model = three_layers()
    opt = distributed(model, hvd.Compression.none, **kwargs)
    grads = [train_step(model, opt, step) for step in range(steps)]
    return grads, flat(p.detach().numpy() for p in model.parameters())


class Oracle:
    """The same out-of-band pipeline in numpy, over the tests' own communicator of the world,
    fed each rank's local gradients (one buffer, the names in sorted order, as the compressor
    fuses them); its sum / P is what each gradient must become."""

    def __init__(self, spec, comm, model):
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.comm = comm
        self.layout = GradientLayout([(name, shapes[name], "float32") for name in sorted(shapes)])
        self.pipeline = horovod_sparse.create(spec).make_pipeline(self.layout.n, comm, layout=self.layout)

    def check(self, reduced, grads, tolerance=1e-5):
        if self.comm.Get_size() == 1:  # a Horovod job of one rank: Horovod's optimizer calls no compressor
            for name, grad in grads.items():
                np.testing.assert_array_equal(reduced[name], grad, err_msg=name)
            return
        summed = self.pipeline.step(self.layout.fuse([grads[e.key] for e in self.layout.entries]), tag=self.layout.tag)
        parts = self.layout.split(np.asarray(summed) / np.float32(self.comm.Get_size()))
        for entry, want in zip(self.layout.entries, parts):
            np.testing.assert_allclose(reduced[entry.key], want, rtol=tolerance, atol=tolerance, err_msg=entry.key)

    def close(self):
        self.pipeline.close()


def test_the_exchanges_world_is_horovods(world):
    """Size, rank and members of the mapped world are Horovod's, in Horovod's order."""
    comm = horovod_world()
    assert (comm.Get_size(), comm.Get_rank()) == (hvd.size(), hvd.rank())
    assert communicator_of(None) is comm
    members = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([CW.Get_rank()], np.int64), members)
    assert members.tolist() == world.members


@pytest.mark.parametrize("spec", ["dense", "topk:density=1.0"])
def test_dense_sums_equal_horovods_own(spec, world):
    """``dense`` and top-k keeping everything give Horovod's own dense result over the world
    (before the fix: 0.02-0.03 away, the sum of COMM_WORLD)."""
    horovods, horovod_params = horovod_dense_run()
    model = three_layers()
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    opt = distributed(model, compression)
    try:
        for step in range(STEPS):
            reduced = train_step(model, opt, step)
            for name, want in horovods[step].items():
                assert_horovod_equal(world.comm, reduced[name], want)
        params = flat(p.detach().numpy() for p in model.parameters())
        assert_horovod_equal(world.comm, params, horovod_params)
        assert_identical(world.comm, params)
        # what a sum over COMM_WORLD would have given is far from it: the check above can tell
        first = local_gradients(three_layers(), 0)
        assert not np.allclose(average(CW, flat(first.values())), average(world.comm, flat(first.values())),
                               atol=1e-3)
    finally:
        compression.close()


@pytest.mark.parametrize("spec", SPARSE_SPECS)
def test_every_out_of_band_compressor_sums_over_its_world(spec, world):
    """Each step's gradients equal the numpy reference over this world; replicas identical."""
    model = three_layers()
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    opt = distributed(model, compression)
    oracle = Oracle(spec, world.comm, model)
    try:
        for step in range(STEPS):
            grads = local_gradients(model, step)
            oracle.check(train_step(model, opt, step), grads)
        assert_identical(world.comm, flat(p.detach().numpy() for p in model.parameters()))
    finally:
        oracle.close()
        compression.close()


@pytest.mark.parametrize("spec", ["dense", "topk:density=0.01", "qsgd"])
def test_a_process_set_inside_a_sub_world(spec, world):
    """Horovod ranks [0, 2] of a 3-rank world (COMM_WORLD ranks 0, 2, or 3, 2 when Horovod's
    world is [3, 1, 2]) train in their process set, its world not mapped before: the set's
    exchange runs among exactly those two processes."""
    if world.process_set is None:
        pytest.skip("process sets are made in the 3-rank worlds")
    forget()  # the set is mapped by its own ranks alone (Horovod's allgather over it)
    in_set = world.process_set.included()
    set_comm = world.comm.Split(int(in_set), hvd.rank())
    try:
        if not in_set:
            return
        assert communicator_of(world.process_set).Get_size() == 2
        members = np.empty(2, np.int64)
        communicator_of(world.process_set).Allgather(np.array([CW.Get_rank()], np.int64), members)
        assert members.tolist() == [world.members[0], world.members[2]]
        model = three_layers()
        if spec == "dense":
            horovods, horovod_params = horovod_dense_run(process_set=world.process_set)
        compression = hvds.Compression.from_spec(spec, dense_below=0)
        opt = distributed(model, compression, process_set=world.process_set)
        oracle = Oracle(spec, set_comm, model)
        try:
            for step in range(STEPS):
                grads = local_gradients(model, step)
                reduced = train_step(model, opt, step)
                oracle.check(reduced, grads)
                if spec == "dense":
                    for name, want in horovods[step].items():
                        np.testing.assert_array_equal(reduced[name], want)
            assert_identical(set_comm, flat(p.detach().numpy() for p in model.parameters()))
        finally:
            oracle.close()
            compression.close()
    finally:
        set_comm.Free()


def test_checkpoints_gather_and_scatter_over_horovods_world(world, assert_same_state):
    """gather_state collects the world's ranks on Horovod's rank 0, in Horovod's order, and
    scatter_state hands each its own part back, bit for bit."""
    model = three_layers()
    compression = hvds.Compression.from_spec("topk:density=0.01", dense_below=0)
    fresh = hvds.Compression.from_spec("topk:density=0.01", dense_below=0)
    opt = distributed(model, compression)
    try:
        for step in range(2):
            train_step(model, opt, step)
        state = gather_state(compression)
        if hvd.rank() == 0:
            assert state["world_size"] == hvd.size() == len(world.members)
        else:
            assert state is None
        scatter_state(fresh, state)
        assert_same_state(fresh.state_dict(), compression.state_dict())
    finally:
        compression.close()
        fresh.close()


@pytest.mark.parametrize("name", ["reversed 4"])
def test_a_world_in_another_order_than_comm_worlds(name):
    """Horovod on every process, in reverse order: the mapped world follows Horovod's ranks (a
    Split), so rank-based choices (roots, seeds) are Horovod's; dense equals Horovod's own."""
    world = init_world(hvd, name)
    comm = horovod_world()
    assert (comm.Get_size(), comm.Get_rank()) == (4, hvd.rank()) == (4, 3 - CW.Get_rank())
    assert SCENARIOS[name][1](CW.Get_rank()) == world.members
    horovods, horovod_params = horovod_dense_run()
    model = three_layers()
    compression = hvds.Compression.from_spec("dense", dense_below=0)
    opt = distributed(model, compression)
    try:
        for step in range(STEPS):
            reduced = train_step(model, opt, step)
            for key, want in horovods[step].items():
                assert_horovod_equal(world.comm, reduced[key], want)
        assert_identical(world.comm, flat(p.detach().numpy() for p in model.parameters()))
    finally:
        compression.close()
