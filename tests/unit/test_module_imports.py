"""Every module of the package imports on its own, first, in a fresh interpreter.

An import cycle (a imports b, which imports a before a has defined what b needs) only
shows when one of its modules is the first imported, e.g. ``import
horovod_sparse.exchange.compressed`` in a new process; a test session that imported
the package some other way first never sees it. So each module gets its own fresh
interpreter here.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import horovod_sparse

PACKAGE = Path(horovod_sparse.__file__).parent


def modules():
    """Dotted names of every module and package under horovod_sparse, found on disk."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def import_alone(name):
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                            env=env, timeout=300)
    return name, result.returncode, result.stderr[-1500:]


@pytest.mark.timeout(900)  # a hundred fresh interpreters, two at a time, on 2 cores
def test_every_module_imports_first_in_a_fresh_interpreter():
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [(name, err) for name, rc, err in pool.map(import_alone, modules()) if rc != 0]
    assert not failures, "\n\n".join(f"import {name} failed:\n{err}" for name, err in failures)
