"""The time-to-accuracy benchmark: its command lines (``--dry-run``), the report's arithmetic on
hand-made records (made-up numbers), the driver's handling of a job that dies in a run, and the
one-minute smoke mode end to end (real mpirun ranks)."""
import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from horovod_sparse.bench import tta
from scripts_under_test import load_script

bench_tta = load_script("bench_tta")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the per-rank program's arguments ----------------------------------------------------------

def test_import_needs_no_torch_or_mpi():
    code = ("import sys, horovod_sparse.bench.tta as t; t.parse_args(['--steps', '2']); "
            "print(sorted(m for m in ('torch', 'horovod', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_budget_is_required_and_the_link_comes_from_netem(monkeypatch):
    monkeypatch.setenv(tta.RATE_ENV, "1gbit")   # what netem.py sets
    a = tta.parse_args(["--seconds", "30"])
    assert (a.workload, a.steps, a.seconds, a.eval_every, a.link) == ("digits_resnet", None, 30.0, 20, "1gbit")
    with pytest.raises(SystemExit):
        tta.parse_args([])
    with pytest.raises(SystemExit):
        tta.parse_args(["--steps", "0"])


def test_default_runs_are_horovods_ours_and_the_peers():
    assert [tta.kind_of(s) for s in tta.DEFAULT_COMPRESSORS] == ["horovod"] * 2 + ["ours"] * 7 + ["ddp"] * 3
    assert tta.DEFAULT_COMPRESSORS[:2] == ("hvd-none", "hvd-fp16")


def test_the_recipe_is_the_workloads_own_unless_named():
    from horovod_sparse.workloads import recipes

    class Workload:
        RECIPE = "adamw"
        RECIPES = {"adamw": recipes.Recipe("adamw", lr=3e-4, weight_decay=0.1)}
    assert recipes.recipe_for(Workload).lr == 3e-4
    assert recipes.recipe_for(Workload, lr=1e-3).lr == 1e-3
    assert recipes.recipe_for(Workload, "momentum") == recipes.RECIPES["momentum"]
    with pytest.raises(ValueError, match="recipe must be one of"):
        recipes.recipe_for(Workload, "adam")
    a = tta.parse_args(["--steps", "2", "--recipe", "momentum", "--model", "layers=4,d_model=256"])
    assert (a.recipe, a.model) == ("momentum", {"layers": 4, "d_model": 256})
    with pytest.raises(SystemExit):
        tta.parse_args(["--steps", "2", "--model", "layers=four"])


def test_warm_up_then_cosine_decay_to_zero():
    from horovod_sparse.workloads.recipes import RECIPES
    adamw = RECIPES["adamw"]
    factors = [adamw.lr_factor(step, 200) for step in range(200)]
    assert factors[:20] == [(s + 1) / 20 for s in range(20)]           # 10% linear warm-up
    assert factors[20] == 1.0 and all(a > b for a, b in zip(factors[20:], factors[21:]))
    assert factors[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 179 / 180)))
    assert RECIPES["sgd"].lr_factor(150, 200) == 1.0


def test_the_peers_use_loopback_or_the_namespaces_own_interface():
    assert tta.gloo_interface("loopback") == ("lo", "127.0.0.1")
    inside = {"lo": "127.0.0.1", "eth0": "198.18.0.3"}
    assert tta.gloo_interface("1gbit", inside, "198.18.0.0/24") == ("eth0", "198.18.0.3")
    with pytest.raises(RuntimeError, match="cannot tell"):
        tta.gloo_interface("1gbit", {**inside, "eth1": "10.0.0.5"}, "")


# -- the driver's command lines ----------------------------------------------------------------

def test_dry_run_prints_one_job_per_workload_and_link_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "tta.jsonl"
    rc = bench_tta.main(["--dry-run", "--links", "loopback", "1gbit", "--compressors", "hvd-none", "ddp-powersgd",
                         "--steps", "50", "--seconds", "90", "--eval-every", "5", "--out", str(out),
                         "--python", "py"])
    assert rc == 0 and not out.exists()
    jobs = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines() if "===" in line]
    assert len(jobs) == 4   # (digits_resnet, stdlib_lm) x (loopback, 1gbit)
    parsed = [shlex.split(job) for job in jobs]
    assert [p[:6] for p in parsed] == [["py", os.path.join("scripts", "netem.py"), "--rate", rate, "-np", "2"]
                                       for rate in ("none", "1gbit") * 2]
    assert all(p[6] == "--mpirun-args=--bind-to none --mca mpi_yield_when_idle 1" for p in parsed)
    # what the driver hands the ranks parses back to the same settings
    ranks = [tta.parse_args(p[p.index("--") + 4:]) for p in parsed]
    assert [(r.workload, r.link) for r in ranks] == [("digits_resnet", "loopback"), ("digits_resnet", "1gbit"),
                                                     ("stdlib_lm", "loopback"), ("stdlib_lm", "1gbit")]
    r = ranks[0]
    assert (r.compressors, r.steps, r.seconds, r.eval_every, r.out) == (["hvd-none", "ddp-powersgd"], 50, 90.0, 5,
                                                                        str(out))
    assert r.batch is None and r.lr is None   # the workload's own


def test_driver_arguments():
    a = bench_tta.parse_args([])
    assert (a.workloads, a.links, a.np, a.out) == (["digits_resnet", "stdlib_lm"], ["loopback", "1gbit", "10gbit"],
                                                   2, "results/tta.jsonl")
    assert a.compressors == list(tta.DEFAULT_COMPRESSORS)
    assert bench_tta.parse_args(["--target", "0.9", "stdlib_lm=2.5"]).targets == {None: 0.9, "stdlib_lm": 2.5}
    assert bench_tta.parse_args(["--report"]).md == "docs/results/accuracy.md"
    for bad in (["--target", "imagenet=0.7"], ["--links", "fast"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench_tta.parse_args(bad)


# -- the report --------------------------------------------------------------------------------

def record(compressor, curve, workload="digits_resnet", link="1gbit", error=None, identical=True, **kw):
    """A made-up run: ``curve`` is [(step, seconds, metric)]."""
    lm = workload == "stdlib_lm"
    r = {"bench": "tta", "timestamp": "2026-11-25T00:00:00+00:00", "workload": workload,
         "metric": "bits_per_byte" if lm else "accuracy", "higher_is_better": not lm,
         "compressor": compressor, "kind": tta.kind_of(compressor), "np": 2, "link": link, "batch": 32,
         "lr": 0.02, "momentum": 0.0, "budget_steps": 60, "budget_seconds": None, "eval_every": 20,
         "curve": [{"step": s, "seconds": t, "metric": m, "loss": 1.0, "train_loss": None} for s, t, m in curve],
         "steps": curve[-1][0] if curve else 0, "seconds": curve[-1][1] if curve else 0.0,
         "replicas_identical": None if error else identical, "error": error,
         "driver_command": "python scripts/bench_tta.py --steps 60"}
    r.update(kw)
    return r


RECORDS = [
    record("hvd-none", [(0, 0, 0.1), (20, 40, 0.5), (40, 80, 0.8), (60, 120, 0.9)]),
    record("hvd-fp16", [(0, 0, 0.1), (20, 30, 0.5), (40, 60, 0.85), (60, 90, 0.9)]),
    record("topk:density=0.01", [(0, 0, 0.1), (20, 10, 0.6), (40, 20, 0.92), (60, 30, 0.88)]),
    record("randomk:density=0.01", [(0, 0, 0.1), (20, 8, 0.3), (40, 16, 0.6), (60, 24, 0.7)]),
    record("ddp-powersgd", [(0, 0, 0.1), (20, 12, 0.4)], error="RuntimeError: Received data size doesn't match"),
]


def test_target_is_horovod_denses_final_metric_unless_given():
    rs = bench_tta.groups(RECORDS)[("digits_resnet", "1gbit", 2)]
    assert bench_tta.target_of(rs, "digits_resnet", {})[0] == 0.9
    assert bench_tta.target_of(rs, "digits_resnet", {None: 0.8})[0] == 0.8
    assert bench_tta.target_of(rs, "digits_resnet", {"digits_resnet": 0.7, None: 0.8})[0] == 0.7
    assert bench_tta.target_of(rs[1:], "digits_resnet", {})[0] is None   # no dense run
    # within 1% of dense's final: worse by 1% of it, in the metric's own direction
    assert bench_tta.target_of(rs, "digits_resnet", {}, tolerance=0.01)[0] == pytest.approx(0.9 * 0.99)
    lm = [dict(r, higher_is_better=False) for r in rs]
    assert bench_tta.target_of(lm, "digits_resnet", {}, tolerance=0.01)[0] == pytest.approx(0.9 * 1.01)


def test_steps_time_and_speed_ups_to_target():
    rows = {r["compressor"]: r for r in bench_tta.summarise(RECORDS, 0.9, higher=True)}
    dense, fp16, topk = rows["hvd-none"], rows["hvd-fp16"], rows["topk:density=0.01"]
    assert (dense["reach_step"], dense["reach_seconds"], dense["vs_dense"]) == (60, 120, 1.0)
    assert (fp16["reach_step"], fp16["reach_seconds"]) == (60, 90)
    assert fp16["vs_dense"] == pytest.approx(120 / 90) and fp16["vs_fp16"] == 1.0
    # the first point at the target counts, though the last falls back below it
    assert (topk["reach_step"], topk["reach_seconds"], topk["final"], topk["best"]) == (40, 20, 0.88, 0.92)
    assert topk["vs_dense"] == pytest.approx(6.0) and topk["vs_fp16"] == pytest.approx(4.5)
    never = rows["randomk:density=0.01"]
    assert never["reach_step"] is None and never["vs_dense"] is None and never["best"] == 0.7


def test_lower_is_better_and_the_initial_model_never_counts():
    lm = [record("hvd-none", [(0, 0, 8.0), (20, 50, 3.0), (40, 100, 2.5)], workload="stdlib_lm"),
          record("qsgd", [(0, 0, 8.0), (20, 30, 2.4), (40, 60, 2.2)], workload="stdlib_lm")]
    rows = {r["compressor"]: r for r in bench_tta.summarise(lm, 2.5, higher=False)}
    assert rows["qsgd"]["reach_step"] == 20 and rows["qsgd"]["vs_dense"] == pytest.approx(100 / 30)
    easy = {r["compressor"]: r for r in bench_tta.summarise(lm, 9.0, higher=False)}
    assert easy["hvd-none"]["reach_step"] == 20   # step 0 already beats 9.0, but is no training


def test_markdown_tables_never_reached_and_failures(tmp_path):
    text = bench_tta.markdown(RECORDS, png_dir="")
    assert "### digits_resnet, 1gbit, P = 2" in text
    assert "target 0.9 = Horovod dense's final accuracy (60 steps, 120.0 s of training)" in text
    assert "| Horovod dense (none) | 60 | 120.0 | 0.9 | 60 | 120.0 | 1.00x | 0.75x | yes |" in text
    assert "| topk:density=0.01 | 60 | 30.0 | 0.88 | 40 | 20.0 | 6.00x | 4.50x | yes |" in text
    assert "| randomk:density=0.01 | 60 | 24.0 | 0.7 | never (best 0.7) | never | | | yes |" in text
    assert ("| DDP powerSGD_hook, rank 1 | 20 | 12.0 | 0.4 | never (best 0.4) | never | | "
            "| failed: RuntimeError: Received data size doesn't match |") in text
    assert "![accuracy against training seconds](accuracy_digits_resnet_1gbit_p2.png)" in text
    assert "`python scripts/bench_tta.py --steps 60`" in text


def test_report_writes_the_block_and_one_plot_per_workload_and_link(tmp_path):
    data = tmp_path / "accuracy.jsonl"
    recs = RECORDS + [record("hvd-none", [(0, 0, 0.1), (60, 40, 0.95)], link="loopback"),
                      record("hvd-none", [(0, 0, 0.1), (60, 41, 0.96)], link="loopback")]   # the later wins
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    md = tmp_path / "accuracy.md"
    md.write_text("# By hand\n\nkept\n\n<!-- tta:begin -->\nold\n<!-- tta:end -->\n\ntail\n")
    assert bench_tta.main(["--report", str(md), "--data", str(data)]) == 0
    doc = md.read_text()
    assert doc.startswith("# By hand\n\nkept") and doc.rstrip().endswith("tail") and "old" not in doc
    assert doc.index("### digits_resnet, loopback") < doc.index("### digits_resnet, 1gbit")
    assert "target 0.96 = Horovod dense's final" in doc
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["accuracy_digits_resnet_1gbit_p2.png",
                                                              "accuracy_digits_resnet_loopback_p2.png"]


def test_the_page_has_the_block_the_report_writes():
    doc = open(os.path.join(REPO, "docs", "results", "accuracy.md")).read()
    assert doc.count("<!-- tta:begin -->") == 1 and doc.count("<!-- tta:end -->") == 1
    assert "python scripts/bench_tta.py --smoke" in doc


# -- a job that dies in a run ------------------------------------------------------------------

def test_a_job_that_dies_in_a_run_is_recorded_and_the_rest_run_again(tmp_path, monkeypatch):
    a = bench_tta.parse_args(["--links", "loopback", "--compressors", "hvd-none", "ddp-powersgd", "qsgd",
                              "--out", str(tmp_path / "tta.jsonl"), "--no-doc"])
    jobs = []

    def fake_job(argv, env, timeout):   # the first job writes hvd-none, then dies in ddp-powersgd
        specs = argv[argv.index("--compressors") + 1:argv.index("--link")]
        jobs.append(specs)
        with open(a.out, "a") as f:
            f.write(json.dumps(record(specs[0], [(0, 0, 0.1), (60, 9, 0.9)])) + "\n")
        with open(bench_tta.started_path(a), "w") as f:
            f.write((specs[1] if len(specs) > 1 else specs[0]) + "\n")
        return (134, False) if len(specs) > 1 else (0, False)

    monkeypatch.setattr(bench_tta, "run_job", fake_job)
    open(a.out, "w").close()
    assert bench_tta.run_workload_link(a, "digits_resnet", "loopback", {}) is False
    assert jobs == [["hvd-none", "ddp-powersgd", "qsgd"], ["qsgd"]]
    recs = {r["compressor"]: r for r in bench_tta.read_records(a.out)}
    assert sorted(recs) == ["ddp-powersgd", "hvd-none", "qsgd"]
    assert recs["ddp-powersgd"]["error"] == "the job died during this run (exit status 134); no record of its own"


def test_a_job_that_never_starts_marks_every_run_not_run(tmp_path, monkeypatch):
    a = bench_tta.parse_args(["--compressors", "hvd-none", "qsgd", "--out", str(tmp_path / "tta.jsonl")])
    monkeypatch.setattr(bench_tta, "run_job", lambda argv, env, timeout: (3, False))
    open(a.out, "w").close()
    assert bench_tta.run_workload_link(a, "stdlib_lm", "1gbit", {}) is False
    errors = [r["error"] for r in bench_tta.read_records(a.out)]
    assert errors == ["not run: the job failed before it (exit status 3)"] * 2


# -- the smoke mode, end to end ----------------------------------------------------------------

def launcher_environment():
    """The environment as Python read it at start-up, given explicitly: another unit test may
    have initialised MPI in this process as a singleton, which setenv()s two dozen PMIx and
    Open MPI job variables into the C environment; a child given no ``env`` inherits them, and
    its mpirun then believes it runs inside that job and exits at once."""
    return dict(os.environ)


@pytest.mark.timeout(420)
def test_smoke_mode_runs_and_checks_its_records():
    result = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_tta.py"), "--smoke",
                             "--python", sys.executable], capture_output=True, text=True, timeout=400,
                            env=launcher_environment())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "smoke ok" in result.stdout
