"""studies/compare_bucket_k.py for real: two short trainings at P = 2 and the table."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from scripts_under_test import load_script

compare = load_script("compare_bucket_k")
# Python's os.environ, passed explicitly: the process's own environment (what a child gets by
# default) holds what an MPI singleton in this pytest process set, and the script's mpirun
# would then believe it runs inside another job
_ENV = dict(os.environ)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_two_short_trainings_compare(tmp_path):
    out = tmp_path / "k.jsonl"
    done = subprocess.run([sys.executable, compare.__file__, "--specs", "dense", "topk:density=0.05,schedule=wfbp",
                           "--steps", "30", "--out", str(out)], capture_output=True, text=True, timeout=300, env=_ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["spec"] for r in recs] == ["dense", "topk:density=0.05,schedule=wfbp"]
    assert recs[0]["buckets"] is None and recs[1]["buckets"] == [1] * 8   # wfbp: one gradient per bucket
    for r in recs:
        assert r["loss_every_10"][-1] < r["loss_every_10"][0]   # it learns
    assert "| `topk:density=0.05,schedule=wfbp` |" in done.stdout and "vs dense" in done.stdout
