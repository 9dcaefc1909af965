"""Real training scripts behind the stock hvd.DistributedOptimizer:
parameters without a gradient in some steps, layers frozen and unfrozen mid-training,
and Horovod process sets.

One compressor of each mechanism: fp16 and randomk ride Horovod's allreduce, topk is a
sparsifier, qsgd a quantizer, PowerSGD low rank; the out-of-band ones run with
dense_below=0 and every weight has 1600 elements, so the gradients really are compressed
(these test this package, not Horovod). Every step is checked against an oracle that
knows each gradient by its parameter's name: an independent numpy reference of the same
math, on the same local gradients, summed with mpi4py; every rank must end with
bitwise-identical parameters, and what cannot be supported fails on every rank.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.layout import GradientLayout
from horovod_sparse.reference import ReferenceCompressor
from horovod_sparse.layout_pipeline import cut

pytestmark = pytest.mark.world_sizes(2, 3)  # process sets: ranks 0..P-2 and the last one, a set of two beside a set of one at 3

WIDTH = 40  # 40 x 40 = 1600 elements per weight
SPECS = ["fp16", "randomk:density=0.1", "topk:density=0.05", "qsgd", "powersgd:rank=2"]
OUT_OF_BAND = ["topk:density=0.05", "qsgd", "powersgd:rank=2"]


def compression_of(spec):
    fused = getattr(horovod_sparse.create(spec), "out_of_band", False)
    return hvds.Compression.from_spec(spec, dense_below=0) if fused else hvds.Compression.from_spec(spec)


class TwoHeads(nn.Module):
    """A trunk and two heads of the same shape; ``forward(x, head)`` uses one of them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.heads = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])

    def forward(self, x, head):
        return self.heads[head](torch.relu(self.trunk(x)))


def three_layers():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH))


def distributed(model, compression, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def loss_of(model, step, *args):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    return torch.nn.functional.mse_loss(model(x, *args), y)


def local_gradients(model, step, *args):
    """This rank's gradients, by name, on a copy of the model (zero where none was computed,
    as Horovod fills them in); frozen parameters have none."""
    twin = copy.deepcopy(model)
    loss_of(twin, step, *args).backward()
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy().copy()
            for name, p in twin.named_parameters() if p.requires_grad}


def train_step(model, opt, step, *args):
    """One step, as a script would run it; returns the averaged gradients by name."""
    opt.zero_grad()
    loss_of(model, step, *args).backward()
    opt.synchronize()
    reduced = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    with opt.skip_synchronize():
        opt.step()
    return reduced


def average(comm, array):
    total = np.empty_like(np.asarray(array, np.float64))
    comm.Allreduce(np.asarray(array, np.float64), total)
    return total / comm.Get_size()


def assert_identical(comm, array):
    local = np.ascontiguousarray(array).view(np.uint8).ravel()
    gathered = np.empty((comm.Get_size(), local.size), np.uint8)
    comm.Allgather(local, gathered)
    assert all(np.array_equal(row, gathered[0]) for row in gathered), "replicas differ across ranks"


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


class Oracle:
    """What the compressor must hand the optimizer, from each rank's local gradients by name:
    a numpy reference of the same compressor (keyed by name; the out-of-band ones as one
    pipeline over the names in sorted order), averaged over ``comm`` with mpi4py."""

    def __init__(self, spec, comm, shapes):
        self.spec, self.comm = spec, comm
        self.out_of_band = getattr(horovod_sparse.create(spec), "out_of_band", False)
        if self.out_of_band:
            self.layout = GradientLayout([(name, shapes[name], "float32") for name in sorted(shapes)])
            self.reference = horovod_sparse.create(spec).make_pipeline(self.layout.n, comm, layout=self.layout)
        else:
            self.reference = ReferenceCompressor.from_spec(spec)

    def expected(self, grads):
        if self.out_of_band:
            summed = self.reference.step(self.layout.fuse([grads[e.key] for e in self.layout.entries]),
                                         tag=self.layout.tag)
            parts = self.layout.split(np.asarray(summed) / np.float32(self.comm.Get_size()))
            return {e.key: part for e, part in zip(self.layout.entries, parts)}
        return {name: average(self.comm, self.reference.decompress(*self.reference.compress(g, name)).astype(np.float32))
                for name, g in grads.items()}

    def check(self, reduced, grads):
        tolerance = 2e-3 if self.spec == "fp16" else 1e-5
        for name, want in self.expected(grads).items():
            np.testing.assert_allclose(reduced[name], want, rtol=tolerance, atol=tolerance, err_msg=name)

    def check_state(self, compression):
        """Each gradient's state is its own: the compressor's, by name, equals the reference's."""
        if self.out_of_band:
            slices, _ = cut(self.layout, self.reference.state_dict())
            ours = compression.state_dict()
            for name, fields in slices.items():
                for field, value in fields.items():
                    np.testing.assert_allclose(ours[name][field], value, rtol=1e-5, atol=1e-6,
                                               err_msg=f"{name} {field}")
        else:
            ours = compression.state_dict()
            for name, entry in self.reference.state_dict().items():
                np.testing.assert_array_equal(ours[name]["residual"], entry["residual"], err_msg=name)

    def close(self):
        if self.out_of_band:
            self.reference.close()


# -- 1. parameters without a gradient in some steps ------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_heads_used_in_alternate_steps_keep_their_own_state(spec, comm):
    """Two same-shape heads in alternate steps: first the same head on every rank (the other
    has no gradient anywhere, Horovod reduces it in synchronize()), then a different head on
    each rank (the ranks compress in different orders). The swap guard: every step equals
    the oracle, and each head's residual equals the reference's under its own name."""
    model, compression = TwoHeads(), compression_of(spec)
    opt = distributed(model, compression)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    oracle = Oracle(spec, comm, shapes)
    start = flat(model).copy()
    try:
        for step in range(6):
            head = step % 2 if step < 2 else (step + hvd.rank()) % 2
            grads = local_gradients(model, step, head)
            oracle.check(train_step(model, opt, step, head), grads)
            if spec != "fp16":
                oracle.check_state(compression)
    finally:
        oracle.close()
    assert_identical(comm, flat(model))
    assert not np.array_equal(flat(model), start)


# -- 2. freezing and unfreezing layers mid-training -------------------------------------------
def residuals_of(compression, names):
    state = compression.state_dict()
    return {name: {field: np.array(value) for field, value in state[name].items()} for name in names}


@pytest.mark.parametrize("spec", SPECS)
def test_layers_frozen_and_unfrozen_mid_training(spec, comm):
    """The first layer is frozen at step 3 and unfrozen at step 6, on every rank. Training goes
    on; a frozen layer does not move and its residual is kept, untouched, and resumed with;
    the other layers' residuals keep their values; replicas stay bitwise identical."""
    model, compression = three_layers(), compression_of(spec)
    opt = distributed(model, compression)
    first = ["0.weight", "0.bias"]
    for step in range(9):
        if step == 3:
            model[0].requires_grad_(False)
            frozen_weights = model[0].weight.detach().clone()
            kept = residuals_of(compression, first) if spec != "fp16" else None
        if step == 6:
            if kept is not None:  # still what it was when frozen, and handed back at unfreezing
                for name, fields in residuals_of(compression, first).items():
                    for field, value in fields.items():
                        np.testing.assert_array_equal(value, kept[name][field], err_msg=name)
            model[0].requires_grad_(True)
        train_step(model, opt, step)
        if 3 <= step < 6:
            assert torch.equal(model[0].weight, frozen_weights)
    assert not torch.equal(model[0].weight, frozen_weights)  # it trains again
    assert np.all(np.isfinite(flat(model)))
    assert_identical(comm, flat(model))


def test_topk_across_freezing_equals_an_independent_oracle(comm):
    """Top-k by an independent numpy oracle (exact top-k by argsort, residuals by name kept by
    the test) through freezing and unfreezing: each step's sums and every residual match."""
    model, compression = three_layers(), compression_of("topk:density=0.05")
    opt = distributed(model, compression)
    residual = {}
    for step in range(9):
        if step in (3, 6):
            model[0].requires_grad_(step == 6)
        grads = local_gradients(model, step)
        names = sorted(grads)
        acc = np.concatenate([grads[n].ravel() + residual.get(n, 0) for n in names]).astype(np.float32)
        local = np.sort(np.argsort(-np.abs(acc), kind="stable")[:int(np.ceil(0.05 * acc.size))])
        kept = np.zeros_like(acc)
        kept[local] = acc[local]
        expected = np.split(average(comm, kept), np.cumsum([grads[n].size for n in names])[:-1])
        acc[local] = 0
        residual.update(zip(names, np.split(acc, np.cumsum([grads[n].size for n in names])[:-1])))
        reduced = train_step(model, opt, step)
        state = compression.state_dict()
        for name, want in zip(names, expected):
            np.testing.assert_allclose(reduced[name].ravel(), want, rtol=1e-5, atol=1e-6, err_msg=name)
        for name, value in residual.items():
            np.testing.assert_array_equal(state[name]["memory_residual"], value, err_msg=name)
    assert_identical(comm, flat(model))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["randomk:density=0.1"] + OUT_OF_BAND)
def test_freezing_on_one_rank_only_fails_on_every_rank(spec):
    """Rank 0 alone freezes the first layer: every rank gets an error, none waits."""
    model, compression = three_layers(), compression_of(spec)
    opt = distributed(model, compression)
    train_step(model, opt, 0)
    if hvd.rank() == 0:
        model[0].requires_grad_(False)
    with pytest.raises(Exception, match=r"exchange different gradients|[Mm]ismatch"):
        train_step(model, opt, 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", OUT_OF_BAND)
def test_a_frozen_parameter_with_a_gradient_is_refused_on_every_rank(spec):
    """A frozen parameter's gradient is not exchanged: one left non-zero (on one rank) is refused."""
    model, compression = three_layers(), compression_of(spec)
    opt = distributed(model, compression)
    model[0].requires_grad_(False)
    opt.zero_grad()
    loss_of(model, 0).backward()
    if hvd.rank() == 0:
        model[0].weight.grad = torch.ones_like(model[0].weight)
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\]: a frozen parameter .* non-zero gradient"):
        opt.synchronize()


# -- 3. Horovod process sets --------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_process_sets_train_among_their_own_ranks(spec, process_sets):
    """Ranks 0..P-2 train one replica in one process set, rank P-1 another in its own set, at
    the same time: each set's exchange runs among its ranks, equals the oracle over the set,
    and the set's replicas stay bitwise identical."""
    index = next(i for i, ps in enumerate(process_sets) if ps.included())
    set_comm = MPI.COMM_WORLD.Split(index, hvd.rank())
    model, compression = three_layers(), compression_of(spec)
    opt = distributed(model, compression, process_set=process_sets[index])
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    oracle = Oracle(spec, set_comm, shapes)
    try:
        for step in range(4):
            grads = local_gradients(model, step)
            oracle.check(train_step(model, opt, step), grads)
        assert_identical(set_comm, flat(model))
    finally:
        oracle.close()
        set_comm.Free()
