"""A rank that is still finishing its last step when another rank's program has exited.

Where Horovod started MPI (``hvd.init()`` before anything imported mpi4py, as in most training
scripts), Horovod finalises MPI on every rank as soon as any rank shuts Horovod down, which a
rank does when its program exits. A rank still inside its last step must then make no MPI
call: one made after the finalisation aborts that rank ("called after MPI_FINALIZE"), one made
during it crashes it (a segfault in ``MPI_Comm_size``, seen once in CI on the checkpoints
page's example under load).

The program below makes that order certain: on rank 1 the last step's second sparse
``decompress`` (after the step's exchange, which the first one made) waits until rank 0's
program has exited, and only then goes on. Both ranks must finish and exit 0.
"""
import pytest

from mpi_program import RUN_TIMEOUT_S, run_mpi_program

PROGRAM = '''
import os
import time

import torch
import horovod.torch as hvd
import horovod_sparse.torch as hvds

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
compression = hvds.Compression.topk(density=0.05, warmup_steps=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
steps = 3
with open("rank0.pid", "w") if hvd.rank() == 0 else open(os.devnull, "w") as f:
    f.write(str(os.getpid()))
for step in range(steps):
    if step == steps - 1 and hvd.rank() == 1:
        rank0 = int(open("rank0.pid").read())
        inner, calls = compression.decompress, []

        def after_rank0_exits(tensor, ctx):
            calls.append(ctx)
            if len([c for c in calls if c is not None and c[0] != "dense"]) == 2 and "waited" not in calls:
                while os.path.exists(f"/proc/{rank0}"):  # rank 0's program has exited
                    time.sleep(0.05)
                time.sleep(1.0)                           # and Horovod has shut down here
                calls.append("waited")
            return inner(tensor, ctx)

        compression.decompress = after_rank0_exits
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(100 * hvd.rank() + step))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), x[:, :64].argmax(1)).backward()
    opt.step()
assert hvd.rank() == 0 or "waited" in calls, "rank 1 never waited: the test did not test"
print("finished", flush=True)
'''


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_rank_finishing_its_last_step_after_another_exited_makes_no_mpi_call(tmp_path):
    (tmp_path / "late.py").write_text(PROGRAM)
    status, output = run_mpi_program(tmp_path, "late.py", 2)
    assert status == 0, f"exited {status}; output of every rank:\n{output[-4000:]}"
    assert output.count("finished") == 2, output[-4000:]
