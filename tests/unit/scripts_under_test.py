"""The scripts of ``scripts/`` (the user's tools) and ``studies/`` (one-off studies) loaded as
modules for their tests (they are not a package)."""
import importlib.util
import os
import sys

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPTS = os.path.join(REPO, "scripts")
STUDIES = os.path.join(REPO, "studies")


def load_script(name):
    """``scripts/<name>.py`` (else ``studies/<name>.py``) as a module named ``hsp_<name>``;
    ``scripts/`` is on ``sys.path`` while it loads, since scripts import each other (bench_step
    imports plot_step)."""
    folder = SCRIPTS if os.path.exists(os.path.join(SCRIPTS, f"{name}.py")) else STUDIES
    sys.path.insert(0, SCRIPTS)
    try:
        spec = importlib.util.spec_from_file_location(f"hsp_{name}", os.path.join(folder, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(SCRIPTS)
