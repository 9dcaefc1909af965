"""The schedule benchmark for real (no mocks): a short loopback run at P = 2 through the
driver (mpirun over TCP on lo, no namespaces, so no root needed), its records and report,
and its usage errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from scripts_under_test import load_script

_REPO = os.path.join(os.path.dirname(__file__), "..", "..")
_SCRIPT = os.path.join(_REPO, "scripts", "bench_schedule.py")
_PYTHON = os.path.join(_REPO, ".venv", "bin", "python")
_ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


bench_schedule = load_script("bench_schedule")


def _python():
    return _PYTHON if os.access(_PYTHON, os.X_OK) else sys.executable


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_quick_loopback_run(tmp_path):
    out = tmp_path / "schedule.jsonl"
    # one planned schedule of Horovod's groups (Horovod's own fusion runs in the compressor's test
    # below; the planners are checked without jobs)
    cmd = [_python(), _SCRIPT, "--links", "loopback", "--schedules", "wfbp",
           "--warmup", "1", "--steps", "2", "--delay-scale", "0.1", "--fit-repeats", "2",
           "--out", str(out), "--no-doc", "--timeout", "100", "--python", _python()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert [r["schedule"] for r in recs] == ["wfbp"]
    for r in recs:
        assert r["link"] == "loopback" and r["np"] == 2
        assert r["replicas_identical"] is True
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0
        assert r["fit_b"] > 0 and r["r2"] <= 1.0
        assert r["command"].startswith("python scripts/bench_schedule.py")
    wfbp = next(r for r in recs if r["schedule"] == "wfbp")
    assert wfbp["buckets"] == wfbp["gradients"] == len(wfbp["plan"])
    # one allreduce per group: wfbp's groups came with Horovod's group-fusion switch
    assert wfbp["env"]["HOROVOD_DISABLE_GROUP_FUSION"] == "1"

    # the report of these records: table rows and the doc block between the markers
    md = tmp_path / "doc.md"
    md.write_text(f"# Doc\n\n{bench_schedule.BEGIN}\nold\n{bench_schedule.END}\n\ntail\n")
    a = bench_schedule.parse_args(["--report", "--data", str(out), "--md", str(md),
                                   "--png", str(tmp_path / "steps.png")])
    assert bench_schedule.report(a) == 0
    doc = md.read_text()
    assert "old" not in doc and doc.rstrip().endswith("tail")
    assert "| loopback | wfbp |" in doc and "within 15%" in doc
    assert (tmp_path / "steps.png").stat().st_size > 0


@pytest.mark.parametrize("argv,message", [(["--links", "fast"], "bad link rate"),
                                          (["--schedules", "asc"], "they need --compressor"),
                                          (["--schedules", "fastest"], "invalid choice"),
                                          (["--steps", "0"], "must be >= 1")])
def test_bad_argument_is_a_usage_error(argv, message):
    done = subprocess.run([_python(), _SCRIPT, *argv], capture_output=True, text=True, timeout=60, env=_ENV)
    assert done.returncode == 2
    assert message in done.stderr


def test_fit_sizes_and_plans_from_a_calibration():
    assert bench_schedule.fit_sizes(1_000_000) == [16384, 65536, 262144, 1_000_000]
    calib = {"compute_s": [0.004, 0.001, 0.001], "sizes": [4_000_000, 1000, 1000], "tail_s": 0.0,
             "batch_time_s": 0.010, "fit": {"a": 0.002, "b": 1e-9, "r2": 1.0}}
    plan, cost = bench_schedule.plan_for("wfbp", calib)
    assert plan == [(0, 1), (1, 2), (2, 3)]
    predicted, sim = bench_schedule.predict("wfbp", plan, cost, calib)
    assert predicted == pytest.approx(calib["batch_time_s"] + sim.overhead)
    # the optimal plan covers every gradient once, in order, and the simulator predicts it no slower
    optimal, _ = bench_schedule.plan_for("optimal", calib)
    assert optimal[0][0] == 0 and optimal[-1][1] == 3 and all(a[1] == b[0] for a, b in zip(optimal, optimal[1:]))
    assert bench_schedule.predict("optimal", optimal, cost, calib)[0] <= predicted + 1e-12
    none, _ = bench_schedule.plan_for("default", calib)
    assert none is None
    assert bench_schedule.predict("default", None, cost, calib)[0] > calib["batch_time_s"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_quick_loopback_run_of_a_compressors_own_schedules(tmp_path):
    out = tmp_path / "oob.jsonl"
    # Horovod's own fusion and the compressor's planned schedule (wfbp's plan is the planners' tests'
    # and the run above's; one job each costs 10-40 s here)
    cmd = [_python(), _SCRIPT, "--links", "loopback", "--compressor", "dense", "--schedules", "default",
           "auto", "--warmup", "1", "--steps", "2", "--delay-scale", "0.1", "--fit-repeats", "2",
           "--out", str(out), "--no-doc", "--timeout", "100", "--python", _python()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = {r["schedule"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"default", "auto"} and all(r["replicas_identical"] for r in recs.values())
    assert recs["default"]["compressor"] == "horovod-none" and recs["auto"]["compressor"] == "dense"
    assert recs["default"]["env"] == {}  # Horovod's own fusion, with Horovod's defaults
    auto = recs["auto"]["schedule_report"]
    assert auto["chosen"] in auto["predicted_s"] and auto["fit_r2"] <= 1.0
    assert recs["auto"]["predicted_ms"] > 0
    assert recs["auto"]["buckets"] == len(recs["auto"]["schedule_report"]["buckets"]) >= 1

    md = tmp_path / "doc.md"
    md.write_text("<!-- schedule-dense:begin -->\n<!-- schedule-dense:end -->\n")
    a = bench_schedule.parse_args(["--report", "--data", str(out), "--md", str(md)])
    assert bench_schedule.report(a) == 0
    doc = md.read_text()
    assert "| loopback | auto |" in doc and "vs Horovod's default fusion" in doc


def test_two_channel_schedules_need_a_compressor():
    with pytest.raises(SystemExit):
        bench_schedule.parse_args(["--schedules", "asc"])
    with pytest.raises(SystemExit):
        bench_schedule.parse_args(["--compressor", "fp16"])
    assert bench_schedule.parse_args(["--compressor", "dense"]).schedules[-2:] == ["asc", "auto"]
