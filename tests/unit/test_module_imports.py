"""Every module of the package imports on its own, first, in a process of its own.

An import cycle (a imports b, which imports a before a has defined what b needs) only
shows when one of its modules is the first imported, e.g. ``import
horovod_sparse.exchange.compressed`` in a new process; a test session that imported
the package some other way first never sees it. So each module is imported first in a
process of its own: a fork of a server that has imported the frameworks the package
builds on and nothing of the package (a fresh interpreter each would spend most of its
time importing TensorFlow and PyTorch again).
"""
import multiprocessing
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


#: what the fork server imports once: the frameworks, and none of the package's own modules
FRAMEWORKS = ["numpy", "numba", "torch", "tensorflow", "horovod.torch", "horovod.tensorflow"]


@pytest.mark.timeout(900)
def test_every_module_imports_first_in_a_process_of_its_own(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")  # the server's environment, set before it starts
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FRAMEWORKS)
    # one module a worker, so each import is the first of the package in its process
    with context.Pool(2, maxtasksperchild=1) as pool:
        pending = {name: pool.apply_async(exec, (f"import {name}",)) for name in modules()}
        failures = []
        for name, result in pending.items():
            try:
                result.get(timeout=300)
            except Exception as error:  # noqa: BLE001 - each failure is reported, with its traceback
                failures.append(f"import {name} failed: {error!r}\n{error.__cause__ or ''}")
    assert not failures, "\n\n".join(failures)
