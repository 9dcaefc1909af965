"""Smoke tests of the step benchmark's argument parsing and report code: no MPI, no torch,
no timing (the numbers below are made up)."""
import json
import os
import subprocess
import sys

import pytest

from horovod_sparse.bench import step
from scripts_under_test import load_script

bench_step = load_script("bench_step")
plot_step = load_script("plot_step")


def test_import_needs_no_torch_or_mpi():
    # a CLI parses the arguments before deciding to run; the heavy imports happen in run()
    code = ("import sys, horovod_sparse.bench.step as s; s.parse_args(['--steps', '2']); "
            "print(sorted(m for m in ('torch', 'horovod', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("link,bps", [("loopback", None), ("none", None), ("1gbit", 1e9),
                                      ("10gbit", 1e10), ("500mbit", 5e8), ("1gibit", 1024 ** 3),
                                      ("125mbps", 1e9)])
def test_link_rates(link, bps):
    assert step.link_bps(link) == bps


def test_bad_link_is_a_usage_error():
    with pytest.raises(SystemExit):
        step.parse_args(["--link", "fast"])
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--links", "1gbit", "fast"])


def test_step_defaults(monkeypatch):
    monkeypatch.delenv(step.RATE_ENV, raising=False)
    a = step.parse_args([])
    assert (a.models, a.steps, a.warmup, a.rounds, a.link) == (["mlp5", "mlp30"], 10, 3, 1, "loopback")
    assert a.compressors[:2] == ["dense", "hvd-fp16"] and len(a.compressors) == 18
    monkeypatch.setenv(step.RATE_ENV, "1gbit")   # what netem.py sets
    assert step.parse_args(["--steps", "8"]).link == "1gbit"
    with pytest.raises(SystemExit):
        step.parse_args(["--steps", "0"])


def test_default_list_covers_every_registered_compressor():
    import horovod_sparse
    named = {s.split(":")[0] for s in step.DEFAULT_COMPRESSORS if not step.is_horovod_spec(s)}
    # Horovod's own two; plain "dense" is the baseline (Horovod's none), "dense:..." ours out of band
    assert named == set(horovod_sparse.available()) - {"none", "fp16", "dense"}


def test_bounds():
    assert step.dense_bytes(29_372_416, 2) == 29_372_416 * 4
    assert step.dense_bytes(10, 1) == 0
    assert step.link_ms(1.25e8, "1gbit") == pytest.approx(1000.0)
    assert step.link_ms(1.25e8, "loopback") is None


def test_summarize_and_vs_dense():
    s = step.summarize([(0.1, 0.2), (0.1, 0.4), (0.3, 0.1)])
    assert s["fwd_bwd_ms"] == pytest.approx(100) and s["step_ms"] == pytest.approx(200)
    assert s["total_ms"] == pytest.approx(400) and s["steps"] == 3 and s["error"] is None
    assert step.summarize([], "boom")["total_ms"] is None
    recs = step.add_vs_dense([{"model": "m", "compressor": "dense", "total_ms": 300.0},
                              {"model": "m", "compressor": "topk", "total_ms": 150.0},
                              {"model": "m", "compressor": "bad", "total_ms": None}])
    assert [r["vs_dense"] for r in recs] == [1.0, 2.0, None]


def _record(compressor, link="loopback", total=100.0, **kw):
    r = {"bench": "step", "timestamp": "2026-11-22T00:00:00+00:00", "model": "mlp5",
         "model_desc": "5 Linear", "params": 29_372_416, "tensors": 10, "batch": 16, "np": 2,
         "link": link, "link_bps": step.link_bps(link), "warmup": 3, "steps_per_round": 10, "rounds": 1,
         "copy_ms": 20.0, "dense_bytes": 1.17e8, "link_ms": step.link_ms(1.17e8, link), "threads": 1,
         "cpus": 2, "torch": "2.13.0", "note": "", "command": "python -m horovod_sparse.bench.step",
         "driver_command": "python scripts/bench_step.py", "compressor": compressor,
         "fwd_bwd_ms": None if total is None else 40.0, "step_ms": None if total is None else total - 40,
         "total_ms": total, "vs_dense": None, "replicas_identical": None if total is None else True,
         "error": None}
    r.update(kw)
    return r


def test_report_tables_and_md_section(tmp_path):
    data = tmp_path / "step.jsonl"
    recs = [_record("dense", total=400.0, vs_dense=1.0), _record("topk:density=0.01", total=200.0, vs_dense=2.0),
            _record("qsgd", total=None, error="ValueError: x|y"),
            _record("dense", link="1gbit", total=1500.0, vs_dense=1.0),
            _record("dense", total=300.0, vs_dense=1.0)]   # a later record of the same key wins
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    loaded = plot_step.load([str(data)])
    assert len(loaded) == 4
    assert [k[2] for k in plot_step.groups(loaded)] == ["loopback", "1gbit"]
    text = plot_step.markdown(loaded, "performance.png")
    assert "| dense (Horovod none) | 40 | 260 | 300 | 1.00x | yes |" in text
    assert "| qsgd | | | | | error: ValueError: x/y |" in text
    assert "python scripts/bench_step.py" in text and "936 ms at 1gbit" in text

    md = tmp_path / "performance.md"
    md.write_text("# Intro by hand\n\nkept\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\ntail\n")
    plot_step.update_md(str(md), text)
    doc = md.read_text()
    assert doc.startswith("# Intro by hand\n\nkept") and doc.rstrip().endswith("tail")
    assert "old" not in doc and doc.count(plot_step.BEGIN) == 1


def test_driver_command_line():
    a = bench_step.parse_args(["--links", "loopback", "1gbit", "--compressors", "dense", "qsgd",
                               "--steps", "2", "--warmup", "1", "--python", "py"])
    loop, slow = (bench_step.link_command(a, link) for link in a.links)
    assert loop[:6] == ["py", os.path.join("scripts", "netem.py"), "--rate", "none", "-np", "2"]
    assert slow[3] == "1gbit" and slow[6].startswith("--mpirun-args=--bind-to none")
    bench = slow[slow.index("--") + 1:]
    assert bench[:3] == ["py", "-m", "horovod_sparse.bench.step"]
    # what the driver hands the ranks parses back to the same settings
    b = step.parse_args(bench[3:])
    assert (b.compressors, b.steps, b.warmup, b.link, b.out) == (["dense", "qsgd"], 2, 1, "1gbit", a.out)
    assert bench_step.parse_args(["--report"]).md == "docs/performance.md"
    assert bench_step.parse_args(["--report", "x.md"]).md == "x.md"


def test_real_workloads_are_models_of_the_step_benchmark():
    import torch
    from horovod_sparse import workloads
    assert step.parse_args(["--models", "digits_resnet", "stdlib_lm", "mlp5"]).models == [
        "digits_resnet", "stdlib_lm", "mlp5"]
    with pytest.raises(SystemExit):
        step.parse_args(["--models", "resnet50"])
    desc, batch = step.describe_model("digits_resnet")
    assert "ResNet-18" in desc and batch == workloads.get("digits_resnet").BATCH
    assert step.describe_model("mlp30") == step.MODELS["mlp30"]
    # every rank the same model and its own batch of the workload's data (rank r's shard)
    (m0, loss0), (m1, loss1) = (step.model_and_loss("digits_resnet", 0, rank, 2) for rank in (0, 1))
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p0, p1)
    first = loss0()
    assert torch.isfinite(first) and first.item() != loss1().item()
    first.backward()
    assert all(p.grad is not None for p in m0.parameters())
    assert loss0().item() == pytest.approx(first.item(), rel=0.2)  # the same batch at every step
