"""scripts/bench_exchange.py over Horovod's collectives (``--transport horovod``): every
algorithm, its sums checked against mpi4py's, and one collective's fixed cost (``--latency``),
on real ranks; ``--pingpong`` (point-to-point) refused there."""
import json

import pytest

from mpi_program import run_mpi_program
from scripts_under_test import SCRIPTS, load_script

bench_exchange = load_script("bench_exchange")


def test_the_horovod_transport_runs_every_algorithm_and_refuses_pingpong(capsys):
    assert bench_exchange.parse_args(["--transport", "horovod"]).algorithms == list(bench_exchange.DEFAULT_ALGORITHMS)
    with pytest.raises(SystemExit):
        bench_exchange.parse_args(["--transport", "horovod", "--pingpong"])
    assert "use --latency" in capsys.readouterr().err


def test_both_transports_give_checked_sums_and_a_latency_record(tmp_path):
    out = tmp_path / "records.jsonl"
    (tmp_path / "bench.py").write_text(f"""
import sys
sys.path.insert(0, {SCRIPTS!r})
import bench_exchange
args = ["--n", "20000", "--repeats", "2", "--warmup", "1", "--no-table", "--out", {str(out)!r}]
rc = 0
for transport in ("mpi", "horovod"):
    rc = rc or bench_exchange.main(["--transport", transport, "--check", *args])
    rc = rc or bench_exchange.main(["--transport", transport, "--latency", *args])
sys.exit(rc)
""")
    status, output = run_mpi_program(tmp_path, "bench.py", 2)
    assert status == 0, output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    exchanges = [(r["transport"], r["algorithm"]) for r in records if r.get("kind") != "latency"]
    assert exchanges == [(t, a) for t in ("mpi", "horovod") for a in bench_exchange.DEFAULT_ALGORITHMS]
    for r in records:
        if r.get("kind") != "latency":  # the sum equals a dense mpi4py reference sum
            assert r["check_max_abs_err"] <= 1e-6 and r["P"] == 2, r
    latencies = {r["transport"]: r["median_s"] for r in records if r.get("kind") == "latency"}
    assert set(latencies) == {"mpi", "horovod"} and all(t > 0 for t in latencies.values())
