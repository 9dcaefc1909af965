"""Training under ``horovodrun --gloo -np 3`` (scripts/run_tests.py; the tests take any count): every
out-of-band exchange runs over Horovod's own collectives
(:class:`~horovod_sparse.horovod_collectives.HorovodCollectives`), chosen for the user; the stock
``hvd.DistributedOptimizer`` trains, every rank ends with bitwise the same parameters, and
``dense`` equals Horovod's own ``none``: bit for bit at P = 2 (a + b either way, halved exactly),
within float32 rounding at P > 2 (Gloo's ring adds Horovod's fused buffer and ours in chunks
that differ). What the transport cannot carry (planned schedules) is refused at the first step
on every rank, with the launch to use instead; nothing hangs.
"""
import io

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse import cli
from horovod_sparse.checkpoint import gather_state, scatter_state
from random_regression import fit_random_regression

STEPS = 6
TRAINED = ["none", "fp16", "dense", "topk:density=0.05", "gtopk:density=0.05", "oktopk:density=0.05",
           "topk:density=0.05,exchange=dsa", "qsgd", "int4", "auto"]


def small_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # 2048 weights go out of band


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def model_and_optimizer(compression):
    model = small_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def train(spec, steps=STEPS, **params):
    """``steps`` steps of a small model on this rank's own data; returns the flat parameters."""
    compression = hvds.Compression.from_spec(spec, **params)
    model, opt = model_and_optimizer(compression)
    try:
        fit_random_regression(model, opt, 32, 8, batch=16, steps=steps, seed=100 + hvd.rank())
        return flat_parameters(model)
    finally:
        getattr(compression, "close", lambda: None)()


def every_rank(flat, name):
    """Every rank's ``flat`` (a 1-D tensor), row r from rank r: Horovod's allgather, not ours."""
    return hvd.allgather(flat[None], name=f"tests.gloo.{name}").numpy()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", TRAINED)
def test_training_gives_every_rank_the_same_parameters(spec):
    flat = train(spec)
    assert torch.isfinite(flat).all()
    rows = every_rank(flat, spec)
    assert all(np.array_equal(rows[r].view(np.uint32), rows[0].view(np.uint32)) for r in range(rows.shape[0]))
    assert not np.array_equal(rows[0], flat_parameters(small_model()).numpy()), "no step changed the parameters"


@pytest.mark.timeout(60)
def test_dense_equals_horovods_own_allreduce():
    ours, horovods = train("dense", dense_below=0).numpy(), train("none").numpy()
    if hvd.size() == 2:
        np.testing.assert_array_equal(ours, horovods)
    else:
        np.testing.assert_allclose(ours, horovods, rtol=1e-5, atol=1e-6 * np.abs(horovods).max())


@pytest.mark.world_sizes(3)  # a refusal: the same at any size
@pytest.mark.timeout(60)
def test_planned_schedules_are_refused_on_every_rank():
    with pytest.raises(ValueError, match=r"schedule='mgwfbp' exchanges on helper threads"):
        train("topk:density=0.05", steps=1, schedule="mgwfbp")
    hvd.barrier()


@pytest.mark.timeout(60)
def test_checkpoints_gather_and_scatter(assert_same_state):
    compression = hvds.Compression.from_spec("topk:density=0.05")
    fresh = hvds.Compression.from_spec("topk:density=0.05")
    model, opt = model_and_optimizer(compression)
    try:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 32) + hvd.rank()).pow(2).mean().backward()
            opt.step()
        state = gather_state(compression)
        assert (state is None) == (hvd.rank() != 0)
        scatter_state(fresh, state)
        assert_same_state(fresh.state_dict(), compression.state_dict())
    finally:
        compression.close()
        fresh.close()


@pytest.mark.timeout(60)
def test_doctor_passes_and_names_the_transport():
    out = io.StringIO()
    code = cli.main(["doctor", "--timeout", "50"], out=out)
    codes = every_rank(torch.tensor([code]), "doctor")
    assert codes.ravel().tolist() == [0] * hvd.size(), out.getvalue()
    if hvd.rank() == 0:
        assert f"OK    world     {hvd.size()} rank(s); transport: Horovod's collectives (gloo launch)" in out.getvalue()
        assert f"OK    link      allreduce over {hvd.size()} ranks" in out.getvalue()
