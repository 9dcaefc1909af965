"""The ``horovod-sparse`` command line: each subcommand on small inputs, and bad arguments
exiting with code 2 and a message. ``profile`` runs in a subprocess (it initialises
Horovod); the rest in process."""
import json
import os
import subprocess
import sys

import pytest

import netai_reference as ref
from horovod_sparse import available, cli
from horovod_sparse.whatif import CodecCost, Gradient, Trace, load
from horovod_sparse.whatif.trace import NETAI_DIR

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "horovod_sparse.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=170)


def _fails(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.fixture
def json_trace(tmp_path):
    grads = [Gradient("fc2.bias", 0.002, 4096, [1024]), Gradient("fc2.weight", 0.0001, 4 * 1024 * 1024, [1024, 1024]),
             Gradient("fc1.weight", 0.004, 4 * 1024 * 1024, [1024, 1024])]
    trace = Trace("toy", grads, 0.02, device="cpu", batch=8,
                  compressors={"dense": CodecCost(0.0, 0.0, "horovod"),
                               "hvd-fp16": CodecCost(0.002, 0.001, "horovod"),
                               "topk:density=0.01": CodecCost(0.0001, 0.004, "out_of_band", 0.01),
                               "qsgd": CodecCost(0.0001, 0.3, "out_of_band")})
    path = tmp_path / "toy.json"
    trace.save(path)
    return str(path)


# ------------------------------------------------------------------------- list
def test_list_shows_every_compressor_with_its_defaults(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines()]
    assert set(available()) <= set(names) and "dense" in names
    topk = next(line for line in out.splitlines() if line.startswith("topk "))
    assert "density=0.01" in topk and "out_of_band" in topk
    auto = next(line for line in out.splitlines() if line.startswith("auto "))
    for default in ("candidates=('fp16', 'topk:density=0.01'", "dense_below=", "min_density=0.01",
                    "profile_steps=3", "trial_steps=3", "nonfinite='propagate'", "warmup_steps=None"):
        assert default in auto, auto


# ----------------------------------------------------------------------- whatif
def test_whatif_json_reproduces_the_reference(capsys):
    argv = ["whatif", "netai:resnet50", "--ratio", "1", "5", "--workers", "16", "64", "--bandwidth", "10", "40",
            "--rule", "netai", "--no-latency", "--no-codec-cost", "--json"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8
    vec = ref.VecAddCost(os.path.join(NETAI_DIR, "cuda_vec_add.log"))
    for r in rows:
        for key in ("ratio", "workers", "gbps", "overhead_s", "scaling"):
            assert key in r
        want = ref.scaling_factor(os.path.join(NETAI_DIR, "resnet50.bk.log"), "resnet50", r["workers"],
                                  r["gbps"] * 1e9, vec, r["ratio"])
        assert r["scaling"] == pytest.approx(want, abs=1e-6)


def test_whatif_table_recommendation_and_plot_on_a_bk_log(tmp_path, capsys):
    png = tmp_path / "vgg16.png"
    log = os.path.join(NETAI_DIR, "vgg16.bk.log")
    assert cli.main(["whatif", log, "--workers", "16", "--bandwidth", "1", "100", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Recommendation" in out and "x100" in out and "none" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_whatif_on_a_json_trace(json_trace, capsys):
    assert cli.main(["whatif", json_trace, "--workers", "2", "8", "--bandwidth", "1", "100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["compressor"] for r in rows} == {"dense", "hvd-fp16", "topk:density=0.01", "qsgd"}
    assert all(0 < r["scaling"] <= 1 for r in rows)
    slow = {r["compressor"]: r for r in rows if r["workers"] == 8 and r["gbps"] == 1}
    assert slow["topk:density=0.01"]["speedup"] > 1 > slow["qsgd"]["speedup"]
    assert cli.main(["whatif", json_trace, "--workers", "8", "--bandwidth", "1", "100"]) == 0
    out = capsys.readouterr().out
    assert "8 workers, 1 Gbit/s: topk:density=0.01" in out
    assert "8 workers, 100 Gbit/s: none" in out


def test_whatif_scales_compute_by_the_measured_forward_and_backward(json_trace, capsys):
    argv = ["whatif", json_trace, "--workers", "8", "--bandwidth", "100", "--json"]
    assert cli.main(argv) == 0
    alone = {r["compressor"]: r for r in json.loads(capsys.readouterr().out)}
    assert cli.main(argv + ["--fwd-bwd", "10"]) == 0   # far slower compute than profiled
    shared = {r["compressor"]: r for r in json.loads(capsys.readouterr().out)}
    assert all(shared[c]["step_s"] > alone[c]["step_s"] for c in alone)
    _fails(capsys, argv + ["--fwd-bwd", "0"], "finite number > 0")


def test_whatif_with_a_fitted_cost(json_trace, capsys):
    argv = ["whatif", json_trace, "--workers", "4", "--cost", "0.0003", "1.2e-9", "--cost-workers", "4", "--json"]
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["gbps"] == pytest.approx(2 * 3 / 4 * 8 / 1.2e-9 / 1e9)
    assert rows[0]["latency_s"] == pytest.approx(0.0003 / 6)


def test_whatif_bad_arguments_exit_2_with_a_message(json_trace, capsys):
    _fails(capsys, ["whatif", json_trace, "--workers", "0"], "must be >= 1")
    _fails(capsys, ["whatif", json_trace, "--bandwidth", "-1"], "finite number > 0")
    _fails(capsys, ["whatif", json_trace, "--bandwidth", "fast"], "expected a number")
    _fails(capsys, ["whatif", "/nonexistent/trace.json"], "no such trace file")
    _fails(capsys, ["whatif", json_trace, "--compressors", "nonesuch"], "compression name must be one of")
    _fails(capsys, ["whatif", json_trace, "--rule", "fastest"], "invalid choice")
    _fails(capsys, ["whatif", json_trace, "--ratio", "2", "--compressors", "topk"], "not allowed with")
    _fails(capsys, ["whatif", json_trace, "--cost", "0.1", "0", "--workers", "4"], "--cost")
    _fails(capsys, ["whatif", "netai:alexnet"], "unknown NetAI trace")
    _fails(capsys, [], "required")
    _fails(capsys, ["frobnicate"], "invalid choice")


# ---------------------------------------------------------------------- profile
def test_profile_writes_a_trace_that_whatif_reads(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    r = _run("profile", "--model", "whatif_tiny_model:tiny", "--batch", "8", "--steps", "2", "--warmup", "1",
             "--repeats", "1", "--compressors", "dense", "topk:density=0.1", "randomk:density=0.1", "--quiet",
             "-o", str(out))
    assert r.returncode == 0, r.stderr
    trace = load(str(out))
    assert [g.name for g in trace.gradients] == ["net.2.bias", "net.2.weight", "net.0.bias", "net.0.weight"]
    assert trace.gradients[1].nbytes == 256 * 8 * 4 and trace.gradients[1].shape == [8, 256]
    assert set(trace.compressors) == {"dense", "topk:density=0.1", "randomk:density=0.1"}
    assert trace.compressors["topk:density=0.1"].carrier == "out_of_band"
    assert trace.compressors["topk:density=0.1"].sent_fraction == pytest.approx(0.1, abs=0.01)
    assert trace.batch_time_s > trace.backward_s > 0 and trace.reduce and trace.copy_s > 0
    assert cli.main(["whatif", str(out), "--workers", "4", "--bandwidth", "1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_profile_on_two_ranks_under_mpirun(tmp_path):
    out = tmp_path / "tiny-p2.json"
    r = _run("profile", "--np", "2", "--model", "whatif_tiny_model:tiny", "--batch", "8", "--steps", "2",
             "--warmup", "1", "--repeats", "1", "--compressors", "dense", "topk:density=0.1", "--quiet",
             "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("compressors costed at P = 2") == 1, r.stdout   # rank 0 alone reports
    trace = load(str(out))
    assert trace.workers == 2 and trace.meta["workers"] == 2
    assert set(trace.compressors) == {"dense", "topk:density=0.1"}
    assert trace.compressors["topk:density=0.1"].decompress_s > 0 and trace.backward_s > 0


def test_profile_of_a_model_make_batch_loss_factory(tmp_path):
    out = tmp_path / "cls.json"
    r = _run("profile", "--model", "whatif_tiny_model:tiny_classifier", "--batch", "4", "--steps", "1",
             "--warmup", "0", "--compressors", "--name", "classifier", "-o", str(out))
    assert r.returncode == 0, r.stderr
    trace = load(str(out))
    assert trace.model == "classifier" and len(trace.gradients) == 4 and not trace.compressors


def test_profile_bad_arguments_exit_2_with_a_message(tmp_path, capsys):
    o = str(tmp_path / "x.json")
    _fails(capsys, ["profile", "--model", "nocolon", "--batch", "2", "-o", o], "package.module:factory")
    _fails(capsys, ["profile", "--model", "no_such_module_xyz:f", "--batch", "2", "-o", o], "cannot import")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:nothing", "--batch", "2", "-o", o], "no attribute")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:not_a_model", "--batch", "2", "-o", o],
           "torch.nn.Module")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:tiny", "-o", o], "--batch")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:tiny", "--batch", "0", "-o", o], "must be >= 1")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:tiny", "--batch", "2", "--device", "tpu", "-o", o],
           "--device")
    _fails(capsys, ["profile", "--model", "whatif_tiny_model:tiny", "--batch", "2", "--compressors", "bogus",
                    "-o", o], "compression name must be one of")
    assert not os.path.exists(o)


# ------------------------------------------------------------------------ bench
def test_bench_forwards_its_arguments_to_the_step_benchmark(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert cli.main(["bench", "--links", "loopback", "--models", "mlp5", "--dry-run"]) == 0
    (cmd,) = calls
    assert cmd[0] == sys.executable and cmd[1] == os.path.join(ROOT, "scripts", "bench_step.py")
    assert cmd[2:] == ["--links", "loopback", "--models", "mlp5", "--dry-run"]


def test_bench_without_a_source_checkout_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_script", lambda: None)
    assert cli.main(["bench", "--np", "2"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_bench_help_reaches_the_driver():
    r = _run("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert "--links" in r.stdout and "--compressors" in r.stdout


def test_the_console_script_is_declared():
    with open(os.path.join(ROOT, "setup.py")) as f:
        assert "horovod-sparse=horovod_sparse.cli:main" in f.read()


#: third-party modules the CLI's code may import without them being install requirements: the
#: frameworks and their companions (the user's own install, or an extra), numba's compiler, and
#: scipy, whose fit only the scripts that refit the exchange costs call
OPTIONAL_IMPORTS = {"torch", "tensorflow", "horovod", "ml_dtypes", "numba", "llvmlite", "scipy"}
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"array_api_compat": "array-api-compat"}


def _third_party_imports(module):
    """Top-level names of the non-stdlib modules imported anywhere in ``module`` and in the
    horovod_sparse modules it reaches (lazy imports inside functions included)."""
    import ast
    found, seen, todo = set(), set(), [module]
    while todo:
        name = todo.pop()
        path = os.path.join(ROOT, *name.split("."))
        path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
        if name in seen or not os.path.isfile(path):
            continue
        seen.add(name)
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for imported in names:
                top = imported.split(".")[0]
                if top == "horovod_sparse":
                    todo.append(imported)
                elif top not in sys.stdlib_module_names:
                    found.add(top)
    return found


def test_what_the_cli_imports_is_installed_with_it():
    """`pip install horovod_sparse` brings every module the CLI runs on (rich's tables and progress,
    matplotlib's `whatif --plot`), apart from the frameworks and the optional kernels."""
    import ast
    with open(os.path.join(ROOT, "setup.py")) as f:
        call = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call)
                    and getattr(n.func, "id", None) == "setup")
    requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "install_requires")
    declared = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in requires}
    needed = {DISTRIBUTIONS.get(m, m) for m in _third_party_imports("horovod_sparse.cli") - OPTIONAL_IMPORTS}
    assert {"rich", "matplotlib"} <= needed, needed   # the walk reaches the lazy imports
    assert needed <= declared, f"imported by the CLI but not in install_requires: {sorted(needed - declared)}"


def test_whatif_auto_prints_the_choice_per_gradient(json_trace, capsys):
    argv = ["whatif", json_trace, "--auto", "fp16", "topk:density=0.01", "--workers", "8", "--bandwidth", "1", "100"]
    assert cli.main(argv + ["--json"]) == 0
    cells = {(c["workers"], c["gbps"]): c for c in json.loads(capsys.readouterr().out)}
    slow, fast = cells[(8, 1.0)], cells[(8, 100.0)]
    # 1 Gbit/s: the 4 MB weights are worth top-k (4 ms of codec against 7 ms each on the wire);
    # 100 Gbit/s: they are not (0.07 ms each on the wire)
    assert slow["choices"]["fc1.weight"] == slow["choices"]["fc2.weight"] == "topk:density=0.01"
    assert all(c in ("none", "fp16") for c in fast["choices"].values())
    assert slow["predicted_s"] > fast["predicted_s"] > 0
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "choice per gradient" in out and "fc1.weight" in out and "note:" not in out
    assert cli.main(argv[:2] + ["--auto", "powersgd:rank=2", "--workers", "8", "--bandwidth", "1"]) == 0
    assert "no codec cost for powersgd:rank=2" in capsys.readouterr().out


def test_whatif_auto_refuses_a_candidate_the_guard_refuses(json_trace, capsys):
    _fails(capsys, ["whatif", json_trace, "--auto", "qsgd"], "--auto: candidates: 'qsgd' has no error feedback")


def test_doctor_bad_arguments_exit_2_with_a_message(capsys, tmp_path):
    _fails(capsys, ["doctor", "--cores", "0"], "must be >= 1")
    _fails(capsys, ["doctor", "--timeout", "-5"], "finite number > 0")
    _fails(capsys, ["doctor", "--profile", str(tmp_path / "absent.json")], "--profile")
    _fails(capsys, ["doctor", "--json", str(tmp_path / "no" / "such" / "r.json")], "--json: no such folder")
    _fails(capsys, ["doctor", "--frobnicate"], "unrecognized arguments")
