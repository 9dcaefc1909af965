"""Ranks whose programs end apart.

Where Horovod started MPI (``hvd.init()`` before anything imported mpi4py, as in most training
scripts), Horovod finalises MPI on every rank as soon as any rank shuts Horovod down, which a
rank does when its program exits. An MPI call a slower rank makes after the finalisation
aborts that rank ("called after MPI_FINALIZE"); one made during it crashes it (segfaults in
CI, under load, on the docs' examples). Two things keep that from happening:

- at its program's end a rank waits, before Horovod shuts down, until every rank has ended its
  program (``horovod_sparse.world``: one Horovod allgather, at most ``EXIT_MEETING_S``); the
  first program below makes an mpi4py call on rank 1 after rank 0's program has ended;
- past that wait (a rank stuck for longer), a rank still inside its last step makes no MPI call
  after the step's exchange; the second program, without the wait, holds rank 1 in its last
  step's second sparse ``decompress`` until rank 0's process has exited.

Both ranks must finish and exit 0.
"""
import pytest

from mpi_program import RUN_TIMEOUT_S, run_mpi_program

TRAINING = '''
import os
import time

import torch
import horovod.torch as hvd
import horovod_sparse.torch as hvds
import horovod_sparse.world

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
compression = hvds.Compression.topk(density=0.05, warmup_steps=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
steps = 3
'''

AFTER_THE_LAST_STEP = TRAINING + '''
for step in range(steps):
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(100 * hvd.rank() + step))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), x[:, :64].argmax(1)).backward()
    opt.step()
if hvd.rank() == 1:
    while not os.path.exists("rank0.ended"):
        time.sleep(0.05)
    time.sleep(2.0)                               # time enough for a shutdown to reach this rank
    assert horovod_sparse.world.horovod_world().Get_size() == 2
print("finished", flush=True)
if hvd.rank() == 0:
    open("rank0.ended", "w").close()              # the last statement of rank 0's program
'''

IN_THE_LAST_STEP = TRAINING + '''
horovod_sparse.world.EXIT_MEETING_S = 0           # rank 0 does not wait for rank 1 at its end
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


def assert_both_ranks_finish(tmp_path, program):
    (tmp_path / "late.py").write_text(program)
    status, output = run_mpi_program(tmp_path, "late.py", 2)
    assert status == 0, f"exited {status}; output of every rank:\n{output[-4000:]}"
    assert output.count("finished") == 2, output[-4000:]


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_rank_ending_its_program_waits_for_the_others_before_horovod_shuts_down(tmp_path):
    assert_both_ranks_finish(tmp_path, AFTER_THE_LAST_STEP)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_rank_finishing_its_last_step_after_another_exited_makes_no_mpi_call(tmp_path):
    assert_both_ranks_finish(tmp_path, IN_THE_LAST_STEP)
