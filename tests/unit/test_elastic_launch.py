"""Elastic Horovod (``horovodrun --min-np/--max-np`` with a host discovery script), launched for
real on this host: a stateless compression trains through ``hvd.elastic.run`` with identical
replicas, and a compressor that keeps state is refused on every rank with a HorovodWorldError
that says why and what to launch instead, before its first exchange (elastic Horovod
re-initialises Horovod on every resize, and that state is not carried across it yet: without
the refusal a resize would leave the ranks disagreeing, or waiting forever)."""
import re

import pytest

from mpi_program import RUN_TIMEOUT_S, run_elastic_program, run_resizing_program

PROGRAM = '''
import hashlib

import torch
import horovod.torch as hvd
import horovod_sparse.torch as hvds
from horovod_sparse.errors import HorovodWorldError

hvd.init()


def elastic_training(compression):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < 5:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * hvd.rank() + state.step))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


print("fp16 trained:", elastic_training(hvds.Compression.fp16), flush=True)
for spec in ["topk:density=0.05", "randomk:density=0.1"]:
    try:
        elastic_training(hvds.Compression.from_spec(spec))
        print(spec, "trained", flush=True)
    except HorovodWorldError as e:
        print(spec, "refused:", e, flush=True)
'''


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_elastic_jobs_train_stateless_compression_and_refuse_stateful_on_every_rank(tmp_path):
    (tmp_path / "elastic.py").write_text(PROGRAM)
    status, output = run_elastic_program(tmp_path, "elastic.py", 2)
    assert status == 0, f"exited {status}; output of every rank:\n{output[-4000:]}"
    digests = re.findall(r"fp16 trained: (\w+)", output)
    assert len(digests) == 2 and digests[0] == digests[1], output[-4000:]  # identical replicas
    for spec, name in [("topk:density=0.05", "topk"), ("randomk:density=0.1", "randomk")]:
        refusals = re.findall(rf"{re.escape(spec)} refused: (.*)", output)
        assert len(refusals) == 2, f"{spec} was not refused on both ranks:\n{output[-4000:]}"
        assert all(r.startswith(f"{name}: elastic Horovod") and "horovodrun --gloo -np N" in r for r in refusals)


RESIZING = '''
import hashlib
import os
import sys
import time

os.environ["HOROVOD_SPARSE_WARMUP_STEPS"] = "0"  # compressed from the first step: residuals to carry

import numpy as np
import torch
import horovod.torch as hvd
import horovod_sparse.torch as hvds
from horovod_sparse import state_format
from horovod_sparse.checkpoint import gather_state, scatter_state
from horovod_sparse.torch.elastic import own_part

SPEC, HOW, STEPS = sys.argv[1], sys.argv[2], 30
if HOW == "killed":  # the survivors wait this long in the step the dead worker left (Horovod's default: 30 s)
    os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = "15"
hvd.init()


def make():
    """A model, its compressor and optimizer, in an elastic state (else the compressor is refused)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    # every gradient out of band, biases too: at 3 ranks Horovod's own allreduce may add in another
    # order from run to run (its fusion depends on timing), and the resumed run must be bit for bit
    compression = hvds.Compression.from_spec(SPEC, dense_below=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    return model, compression, opt, hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression)


def one_step(model, opt, step):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * hvd.rank() + step))
    opt.zero_grad()
    loss = (model(x) - 0.5 * x[:, :32]).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


model, compression, opt, _ = make()
state = hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression, step=0, shrunk=False,
                               regrown=False, loss=0.0)
reports = []
seen = {"size": hvd.size(), "own": None}  # the world of the last step, this rank's own state at its commit


@hvd.elastic.run
def train(state):
    # 3 workers, then 2, then 3 again: the worker on 127.0.0.1 is removed (the discovery script
    # drops it while ./phase says 1) or dies in the middle of a step (Horovod blacklists its host
    # for 1-2 s, then starts it again)
    while (state.step < STEPS or not state.regrown) and state.step < 400:
        if hvd.size() != seen["size"] and seen["own"] is not None:  # a rank that stayed, in a new world
            now = own_part(compression.state_dict())
            print("kept", hvd.rank(), bool(now) and state_format.encode(now).tobytes()
                  == state_format.encode(seen["own"]).tobytes(), flush=True)
        seen["size"] = hvd.size()
        if HOW == "killed" and state.step == 8 and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
            model(torch.ones(1, 64)).sum().backward()  # its gradients are on their way...
            os._exit(1)                                # ...and it is gone
        state.loss = one_step(model, opt, state.step)
        state.step += 1
        if compression.elastic_report is not None and compression.elastic_report not in reports:
            reports.append(compression.elastic_report)
            print("report", hvd.rank(), compression.elastic_report.size_before, compression.elastic_report.size,
                  compression.elastic_report.departed, compression.elastic_report.joined, flush=True)
        state.shrunk = state.shrunk or hvd.size() == 2
        state.regrown = state.regrown or (state.shrunk and hvd.size() == 3)
        if HOW == "removed" and hvd.rank() == 0 and state.step >= 8:
            open("phase", "w").write("1" if not state.shrunk else "2")
        time.sleep(0.05)
        seen["own"] = own_part(compression.state_dict())  # what commit() saves (before it may raise)
        state.commit()


train(state)
print("done", hvd.rank(), hvd.size(), state.step, digest(model), flush=True)
own = compression.state_dict()
own = own["candidates"][sorted(own["candidates"])[0]] if "auto" in own else own  # auto: its first candidate's
print("residuals", hvd.rank(), sum(key != "(fused)" for key in own), flush=True)
print("phase", hvd.rank(), compression.auto_report["phase"] if "auto" in SPEC else "-", flush=True)

# a checkpoint after the resizes resumes bit-exact: two more steps from it equal two more steps
saved = gather_state(compression)
again, fresh, opt_again, _ = make()
again.load_state_dict(model.state_dict())
scatter_state(fresh, saved)
for step in range(state.step, state.step + 2):
    one_step(model, opt, step)
    one_step(again, opt_again, step)
print("resumed", hvd.rank(), digest(model) == digest(again), flush=True)

# the same number of steps, uninterrupted at 3 workers: the loss it ends at
plain, _, opt_plain, _ = make()
for step in range(state.step):
    plain_loss = one_step(plain, opt_plain, step)
print("losses", hvd.rank(), state.loss, plain_loss, flush=True)
'''


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
# the two ways of leaving, each with a compressor whose state is carried differently: Ok-Topk's
# residuals (top-k's, gTop-k's and PowerSGD's are carried the same way; the whole-buffer state that
# starts afresh, the exchanges' thresholds and PowerSGD's Q's, is test_elastic_carry.py's) through a
# worker killed in the middle of a step, and auto's decision through a removed worker
@pytest.mark.parametrize("spec, how", [("oktopk:density=0.05", "killed"),
                                       ("auto:profile_steps=2,trial_steps=2,max_trials=2", "removed")])
def test_a_job_that_loses_a_worker_and_regains_it_carries_the_compressors_state(tmp_path, spec, how):
    (tmp_path / "resizing.py").write_text(RESIZING)
    status, output = run_resizing_program(tmp_path, "resizing.py", spec, how)
    assert status == 0, f"exited {status}; output of every rank:\n{output[-4000:]}"
    done = re.findall(r"done (\d) (\d) (\d+) (\w+)", output)
    assert len(done) == 3 and {d[1] for d in done} == {"3"} and len({d[2:] for d in done}) == 1, output[-4000:]
    # the two ranks that stayed saw both changes, the one that came back the second only: the same report each
    reports = re.findall(r"report (\d) (\d) (\d) (\d) (\d)", output)
    assert sorted(r[1:] for r in reports) == [("2", "3", "0", "1")] * 3 + [("3", "2", "1", "0")] * 2, output[-4000:]
    # the ranks that stayed held their own residuals, as committed, after each change of world
    kept = re.findall(r"kept \d (\w+)", output)
    assert len(kept) >= 4 and set(kept) == {"True"}, output[-4000:]
    if spec.startswith("auto"):  # its decision carried to the rank that joined: the same phase on every rank
        assert len(set(re.findall(r"phase \d (\w+)", output))) == 1, output[-4000:]
    else:  # compressed steps (not a warm-up), and a resume bit for bit; auto's choices of none and fp16
        # go through Horovod's allreduce, whose order of additions at 3 ranks may differ between runs
        assert re.findall(r"residuals \d (\d+)", output) == ["4"] * 3, output[-4000:]
        assert re.findall(r"resumed \d (\w+)", output) == ["True"] * 3, output[-4000:]
    for resized, plain in re.findall(r"losses \d ([\d.e-]+) ([\d.e-]+)", output):
        assert abs(float(resized) - float(plain)) <= 0.25 * float(plain), output[-4000:]
