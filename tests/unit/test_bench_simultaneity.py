"""The simultaneity benchmark for real: a short loopback run at P = 2 (mpirun over TCP on
lo, two channel threads on Dup'd communicators), its records and report; the fit on exact
synthetic records; usage errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest
from scripts_under_test import load_script

_REPO = os.path.join(os.path.dirname(__file__), "..", "..")
_SCRIPT = os.path.join(_REPO, "scripts", "bench_simultaneity.py")
_ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}


bench = load_script("bench_simultaneity")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_quick_loopback_run(tmp_path):
    out, md = tmp_path / "sim.jsonl", tmp_path / "page.md"
    md.write_text("# page\n\n<!-- simultaneity:begin -->\nold\n<!-- simultaneity:end -->\n\nafter\n")
    done = subprocess.run([sys.executable, _SCRIPT, "--links", "loopback", "--sizes", "16384", "262144", "1048576",
                           "--repeats", "2", "--out", str(out), "--md", str(md)],
                          capture_output=True, text=True, timeout=170, env=_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bytes"] for r in records] == [16384, 262144, 1048576]
    assert all(r["link"] == "loopback" and r["np"] == 2 and r["alone_s"] > 0 and r["together_s"] > 0
               for r in records)
    page = md.read_text()
    assert "old" not in page and "| loopback | 2 |" in page and page.rstrip().endswith("after")


def test_k2_and_the_asc_outlook_from_exact_records():
    # alone = 1 ms + 1 ns/B, together = 1 ms + 1.5 ns/B: k2 = 1.5, both fits exact
    sizes = [2 ** e for e in range(16, 26, 2)]
    records = [dict(link="1gbit", np=2, bytes=m, alone_s=1e-3 + 1e-9 * m, together_s=1e-3 + 1.5e-9 * m)
               for m in sizes]
    (row,) = bench.summarize(records)
    assert row["k2"] == pytest.approx(1.5) and row["r2"] == pytest.approx(1.0)
    assert row["a"] == pytest.approx(1e-3) and row["b"] == pytest.approx(1e-9)
    # the scheduling benchmark's calibration at 1 Gbit/s ships in docs/results/data/schedule/
    assert row["asc"] is not None and row["asc"]["asc"] <= row["asc"]["optimal"] * (1 + 1e-9)
    text = bench.markdown([row], bench.parse_args(["--out", os.path.join(_REPO, "results", "x.jsonl")]))
    assert "| 1gbit | 2 |" in text and "**1.50**" in text


def test_usage_errors(capsys):
    for argv, message in ((["--np", "1"], "--np must be >= 2"), (["--repeats", "0"], "--repeats must be >= 1")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
