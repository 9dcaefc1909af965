"""Elastic Horovod (``horovodrun --min-np/--max-np`` with a host discovery script), launched for
real on this host: a stateless compression trains through ``hvd.elastic.run`` with identical
replicas, and a compressor that keeps state is refused on every rank with a HorovodWorldError
that says why and what to launch instead, before its first exchange (elastic Horovod
re-initialises Horovod on every resize, and that state is not carried across it yet: without
the refusal a resize would leave the ranks disagreeing, or waiting forever)."""
import re

import pytest

from mpi_program import RUN_TIMEOUT_S, run_elastic_program

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
