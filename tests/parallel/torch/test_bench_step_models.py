"""The step benchmark's real workloads under mpirun (``--models digits_resnet stdlib_lm``): each
compressor's run ends without error and with bitwise-identical replicas on every rank, as the
benchmark itself checks. One timed step after one warm-up: this checks the harness, not speed."""
import pytest

from horovod_sparse.bench import step

pytestmark = pytest.mark.world_sizes(2)  # the benchmark's harness, not the exchange


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["digits_resnet", "stdlib_lm"])
def test_real_workloads_run_through_the_step_benchmark(model, comm):
    args = step.parse_args(["--models", model, "--steps", "1", "--warmup", "1"])
    bench = step.Bench(args)
    for spec in ("dense", "topk:density=0.01"):
        times, digest, _, error = bench.run_one(model, spec)
        assert error is None, f"{spec}: {error}"
        assert len(times) == 1 and all(t > 0 for t in times[0])
        assert len(set(comm.allgather(digest))) == 1, f"{spec}: replicas differ"
