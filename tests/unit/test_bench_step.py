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
    assert a.compressors[:2] == ["dense", "hvd-fp16"] and len(a.compressors) == 19
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
    assert bench_step.parse_args(["--report"]).md == "docs/results/performance.md"
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


# ------------------------------------------------------------------ --framework tensorflow
def test_framework_options(monkeypatch):
    monkeypatch.delenv(step.RATE_ENV, raising=False)
    a = step.parse_args([])
    assert (a.framework, a.tf_groups) == ("torch", 0)
    b = step.parse_args(["--framework", "tensorflow", "--tf-groups", "2", "--models", "mlp5", "cnn"])
    assert (b.framework, b.tf_groups, b.models) == ("tensorflow", 2, ["mlp5", "cnn"])
    for bad in (["--framework", "jax"], ["--tf-groups", "2"],               # groups are TensorFlow's
                ["--framework", "tensorflow", "--tf-groups", "-1"],
                ["--framework", "tensorflow", "--models", "digits_resnet"]):  # workloads are PyTorch's
        with pytest.raises(SystemExit):
            step.parse_args(bad)


def test_import_of_the_tf_runner_needs_no_tensorflow():
    code = ("import sys, horovod_sparse.bench.step_tf, horovod_sparse.bench.step as d; "
            "print(d.bench_class('tensorflow') is d.TFBench, d.bench_class('torch') is d.Bench, "
            "sorted(m for m in ('tensorflow', 'torch', 'horovod', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True True []"


def test_summarize_a_step_without_parts():
    # TensorFlow's one traced step: no fwd+bwd / opt.step split, the whole step only
    s = step.summarize([(0.3,), (0.1,), (0.2,)])
    assert s["fwd_bwd_ms"] is None and s["step_ms"] is None
    assert s["total_ms"] == pytest.approx(200) and s["total_ms_max"] == pytest.approx(300) and s["steps"] == 3
    line = step.format_line({"framework": "tensorflow", "model": "mlp5", "np": 2, "link": "loopback",
                             "compressor": "dense", **s, "replicas_identical": True, "vs_dense": 1.0})
    assert line == "[step] mlp5 P=2 loopback dense: step 200 ms  identical yes  1.00x dense"
    assert "opt.step" in step.format_line({"model": "m", "np": 2, "link": "loopback", "compressor": "dense",
                                           **step.summarize([(0.1, 0.1)])})   # a record without framework: torch


def test_digest_is_bitwise():
    import numpy as np
    a = [np.ones(3, np.float32), np.zeros((2, 2), np.float32)]
    assert step.hash_values(a) == step.hash_values([x.copy() for x in a])
    b = [a[0].copy(), a[1].copy()]
    b[1][0, 0] = np.float32(1e-45)   # one denormal bit
    assert step.hash_values(a) != step.hash_values(b)


def test_keras_models_match_the_torch_ones():
    from horovod_sparse.models import build_keras_model, build_model
    for name in ("mlp30", "cnn"):
        torch_model, torch_in, torch_out = build_model(name)
        keras_model, keras_in, keras_out = build_keras_model(name)
        assert keras_model.count_params() == sum(p.numel() for p in torch_model.parameters())
        shapes = sorted(sorted(p.shape) for p in torch_model.parameters())   # (out, in) vs (in, out), OIHW vs HWIO
        assert shapes == sorted(sorted(v.shape) for v in keras_model.trainable_variables)
        assert torch_out == keras_out and sorted(torch_in) == sorted(keras_in)


def test_tf_driver_files_and_command_line():
    a = bench_step.parse_args(["--framework", "tensorflow", "--tf-groups", "1", "--links", "1gbit",
                               "--models", "mlp5", "--python", "py"])
    assert (a.out, a.data, a.png) == ("results/step-tf.jsonl", "docs/results/data/step-tf.jsonl", "docs/results/performance_tf.png")
    bench = bench_step.link_command(a, "1gbit")
    b = step.parse_args(bench[bench.index("--") + 4:])
    assert (b.framework, b.tf_groups, b.models, b.out) == ("tensorflow", 1, ["mlp5"], "results/step-tf.jsonl")
    t = bench_step.parse_args([])   # PyTorch keeps today's files
    assert (t.framework, t.out, t.data, t.png) == ("torch", "results/step.jsonl", "docs/results/performance.jsonl",
                                                   "docs/results/performance.png")
    assert "--tf-groups" not in bench_step.link_command(t, "loopback")
    assert bench_step.parse_args(["--framework", "tensorflow", "--data", "d.jsonl"]).data == "d.jsonl"
    for bad in (["--compare-torch", "t.jsonl"], ["--tf-groups", "1"],
                ["--framework", "tensorflow", "--models", "stdlib_lm"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)


def _tf_record(compressor, total, **kw):
    r = _record(compressor, total=total, framework="tensorflow", tensorflow="2.21.0", tf_groups=0,
                compute_ms=70.0, fwd_bwd_ms=None, step_ms=None, **kw)
    r.pop("torch")
    return r


def test_tf_tables_beside_torch_and_their_own_block(tmp_path):
    data = tmp_path / "mixed.jsonl"
    torch_recs = [_record("dense", total=400.0, vs_dense=1.0), _record("topk:density=0.01", total=200.0, vs_dense=2.0),
                  _record("hvd-fp16", total=300.0, vs_dense=400 / 300)]
    tf_recs = [_tf_record("dense", 500.0, vs_dense=1.0), _tf_record("topk:density=0.01", 312.5, vs_dense=1.6),
               _tf_record("hvd-fp16", None, error="RuntimeError: a|b"),
               _tf_record("qsgd", 250.0, vs_dense=2.0)]   # no PyTorch record of qsgd
    data.write_text("".join(json.dumps(r) + "\n" for r in torch_recs + tf_recs))
    # old records have no framework field: PyTorch's; one file may hold both, each reads its own
    assert "framework" not in torch_recs[0]
    assert len(plot_step.load([str(data)], "torch")) == 3 and len(plot_step.load([str(data)], "tensorflow")) == 4
    assert len(plot_step.load([str(data)])) == 7
    tf_loaded = plot_step.load([str(data)], "tensorflow")
    assert plot_step.torch_speedups(tf_loaded, plot_step.load([str(data)], "torch"))[1] == (2.0, pytest.approx(0.8))

    text = plot_step.section(tf_loaded, "performance_tf.png", "tensorflow", str(data))
    assert "| compressor | step ms | vs dense | identical | torch vs dense | TF / torch |" in text
    assert "| dense (Horovod none) | 500 | 1.00x | yes | 1.00x | 1.00 |" in text
    assert "| topk:density=0.01 | 312 | 1.60x | yes | 2.00x | 0.80 |" in text
    assert "| fp16 (Horovod) | | | error: RuntimeError: a/b | 1.33x | |" in text
    assert "| qsgd | 250 | 2.00x | yes | | |" in text
    assert "TensorFlow 2.21.0, one allreduce request per gradient" in text and "`tf.GradientTape`) takes 70 ms" in text
    alone = plot_step.section(tf_loaded, None, "tensorflow")   # no --compare-torch: no PyTorch columns
    assert "| compressor | step ms | vs dense | identical |\n" in alone and "TF / torch" not in alone

    # each framework rewrites its own block only; TensorFlow's is appended under its heading if absent
    md = tmp_path / "performance.md"
    md.write_text("# Intro\n\n<!-- results:begin -->\nold torch\n<!-- results:end -->\n\ntail\n")
    plot_step.update_md(str(md), text, "tensorflow")
    doc = md.read_text()
    tf_begin = "<!-- results-tf:begin -->"
    assert "old torch" in doc
    assert doc.index("tail") < doc.index("## TensorFlow: step time through DistributedGradientTape")
    assert doc.rstrip().endswith("<!-- results-tf:end -->")
    plot_step.update_md(str(md), plot_step.markdown(plot_step.load([str(data)], "torch")))
    again = md.read_text()
    assert "old torch" not in again and again.split(tf_begin)[1] == doc.split(tf_begin)[1]
    plot_step.update_md(str(md), "new tf", "tensorflow")
    assert again.split(tf_begin)[0] == md.read_text().split(tf_begin)[0]
    assert md.read_text().count("## TensorFlow") == 1


def test_tf_report_regenerates_only_its_block(tmp_path, monkeypatch):
    data, torch_data, md, png = (tmp_path / n for n in ("tf.jsonl", "torch.jsonl", "p.md", "p_tf.png"))
    data.write_text("".join(json.dumps(r) + "\n" for r in [_tf_record("dense", 500.0, vs_dense=1.0)]))
    torch_data.write_text(json.dumps(_record("dense", total=400.0, vs_dense=1.0)) + "\n")
    md.write_text("# Intro\n\n<!-- results:begin -->\ntorch tables\n<!-- results:end -->\n")
    monkeypatch.setattr(bench_step.plot_step, "plot", lambda recs, path, framework: open(path, "w").close())
    a = bench_step.parse_args(["--framework", "tensorflow", "--report", str(md), "--data", str(data),
                               "--png", str(png), "--compare-torch", str(torch_data)])
    assert bench_step.report(a) == 0
    doc = md.read_text()
    assert "torch tables" in doc and "![TensorFlow step time per compressor](p_tf.png)" in doc
    assert "| dense (Horovod none) | 500 | 1.00x | yes | 1.00x | 1.00 |" in doc
    # torch's report of a file holding only TensorFlow records finds none
    assert bench_step.report(bench_step.parse_args(["--report", str(md), "--data", str(data)])) == 1


def test_keras_api_option_and_its_own_tables():
    """``--tf-api keras`` passes through the driver to the ranks, belongs to TensorFlow, and its
    records form their own tables (a Keras run never replaces the tape's rows)."""
    a = bench_step.parse_args(["--framework", "tensorflow", "--tf-api", "keras", "--models", "mlp5"])
    bench = bench_step.link_command(a, "loopback")
    assert step.parse_args(bench[bench.index("--") + 4:]).tf_api == "keras"
    assert "--tf-api" not in bench_step.link_command(bench_step.parse_args(["--framework", "tensorflow"]), "loopback")
    for bad in (["--tf-api", "keras"], ["--framework", "tensorflow", "--tf-api", "jax"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)
    tape = [_tf_record("dense", 500.0, vs_dense=1.0), _tf_record("topk:density=0.01", 250.0, vs_dense=2.0)]
    keras = [_tf_record("dense", 600.0, vs_dense=1.0, tf_api="keras"),
             _tf_record("topk:density=0.01", 400.0, vs_dense=1.5, tf_api="keras")]
    groups = plot_step.groups(tape + keras)
    assert [key[3] for key in groups] == ["tape", "keras"]
    assert [r["total_ms"] for r in groups[next(iter(groups))]] == [500.0, 250.0]
    text = plot_step.markdown_tf(tape + keras)
    assert text.count("Keras `model.train_on_batch`") == 1 and "| 400 | 1.50x |" in text


def test_a_planned_schedule_is_warm_up_until_it_has_kept_a_plan():
    """The timed steps of a planned schedule are its plan's: until its report says which plan it
    kept, bench_step keeps warming up (real compressors of both frontends, before any step)."""
    import horovod_sparse.tensorflow as hvds_tf
    import horovod_sparse.torch as hvds_torch
    for hvds in (hvds_torch, hvds_tf):
        assert step.schedule_settled(hvds.Compression.topk(density=0.01))          # after_backward
        planned = hvds.Compression.topk(density=0.01, schedule="mgwfbp")
        assert not step.schedule_settled(planned) and step.schedule_summary(planned) is None
    assert step.schedule_settled(hvds_tf.Compression.topk(density=0.01, schedule="wfbp"))  # Horovod's calls
    assert not step.schedule_settled(hvds_torch.Compression.topk(density=0.01, schedule="wfbp"))  # planned
    assert step.schedule_settled(hvds_torch.Compression.fp16)   # no schedule at all


def test_recipe_and_model_size_reach_the_ranks_and_are_checked():
    a = bench_step.parse_args(["--links", "1gbit", "--models", "stdlib_lm", "--recipe", "adamw",
                               "--model", "layers=4,d_model=256", "--compressors", "dense"])
    bench = bench_step.link_command(a, "1gbit")
    b = step.parse_args(bench[bench.index("--") + 4:])
    assert (b.recipe, b.model, b.lr) == ("adamw", {"layers": 4, "d_model": 256}, None)  # the recipe's own rate
    assert step.parse_args([]).lr == step.PLAIN_SGD_LR and step.parse_args([]).recipe is None
    for bad in (["--model", "layers=4"],                                   # mlp5 and mlp30 have no size
                ["--models", "stdlib_lm", "digits_resnet", "--model", "layers=4"],
                ["--framework", "tensorflow", "--recipe", "adamw"],
                ["--recipe", "lion"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)
        with pytest.raises(SystemExit):
            step.parse_args(bad)
