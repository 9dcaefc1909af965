"""The main job's output stays readable under horovodrun: horovodrun tags
every chunk a rank writes with ``[1,0]<stdout>:``, so a table line written in pieces, or with
multi-byte box characters, gets a tag in its middle. Runs the README's launch on 2 ranks with
two short runs and checks that each table line arrives whole, behind exactly one tag."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAG = re.compile(r"\[\d+,\d+\]<std(out|err)>:")


def test_demo_table_lines_arrive_whole_under_horovodrun():
    horovodrun = Path(sys.executable).parent / "horovodrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    runs = ["dense", "topk:density=0.01"]
    proc = subprocess.run(
        [str(horovodrun), "-np", "2", "-H", "localhost:2",
         "--mpi-args=--oversubscribe --mca mpi_yield_when_idle 1",
         sys.executable, "scripts/demo.py", "--runs", *runs, "--epochs", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert all(line.isascii() for line in lines), [line for line in lines if not line.isascii()]
    assert all(len(TAG.findall(line)) <= 1 for line in lines), "a tag in the middle of a line"
    body = [TAG.sub("", line, count=1) for line in lines]
    header = [i for i, line in enumerate(body) if line.split()[:2] == ["compression", "test"]]
    assert len(header) == 1, proc.stdout[-3000:]
    start = header[0]
    assert set(body[start + 1].replace(" ", "")) == {"-"}  # the rule under the header
    for run, line in zip(runs, body[start + 2:start + 2 + len(runs)]):
        cells = line.split()
        assert cells[0] == run and len(cells) == 6 and cells[-1] == "yes", line
