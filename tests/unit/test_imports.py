"""Each frontend imports only its own framework; the TensorFlow frontend refuses Keras 3."""
import os
import subprocess
import sys

import pytest


def run_python(code, **env):
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                          timeout=120)


@pytest.mark.parametrize("module,absent", [("horovod_sparse.torch", "tensorflow"),
                                           ("horovod_sparse.tensorflow", "torch"),
                                           ("horovod_sparse", "torch")])
def test_frontend_imports_only_its_framework(module, absent):
    result = run_python(f"import sys, {module}; print({absent!r} in sys.modules)", TF_USE_LEGACY_KERAS="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_keras3_is_refused_with_what_to_do():
    result = run_python("import horovod_sparse.tensorflow")
    assert result.returncode != 0
    assert "KerasVersionError" in result.stderr
    assert "TF_USE_LEGACY_KERAS=1" in result.stderr


def test_legacy_keras_is_accepted():
    result = run_python("import horovod_sparse.tensorflow as h, tensorflow as tf; print(tf.keras.__name__)",
                        TF_USE_LEGACY_KERAS="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith("tf_keras")
