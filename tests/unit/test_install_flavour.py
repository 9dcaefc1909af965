"""The install's two flavours (``scripts/versions.sh``), run with real bash and nothing built:
``scripts/build_horovod.sh --print-plan`` prints the flavour, the wheel's cache folder and the
build's settings, and the GPU flavour (``HOROVOD_SPARSE_GPU=1``) fails first, naming what is
missing, where there is no CUDA toolkit or no pip NCCL."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BUILD = os.path.join(ROOT, "scripts", "build_horovod.sh")
INSTALL = os.path.join(ROOT, "scripts", "install.sh")
#: the CPU flavour's settings, as the build passed them before the GPU flavour existed
CPU_SETTINGS = ["HOROVOD_WITH_MPI=1", "HOROVOD_WITH_PYTORCH=1", "HOROVOD_WITH_TENSORFLOW=1",
                "HOROVOD_WITH_GLOO=1", "HOROVOD_WITHOUT_MXNET=1", "HOROVOD_CPU_OPERATIONS=MPI"]


def path_without_nvcc():
    """This PATH less every folder holding an nvcc: a machine without the CUDA toolkit."""
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "nvcc")))


def fake_toolkit(tmp_path):
    """A folder shaped like a CUDA toolkit whose bin/nvcc runs and says nothing (no dry run)."""
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    return tmp_path / "cuda"


def fake_nccl(tmp_path):
    """A site folder holding what pip's nvidia-nccl puts there: nvidia/nccl/{include,lib}."""
    nccl = tmp_path / "site" / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    return nccl


def run(script, tmp_path, gpu=None, path=None, extra=None, args=("--print-plan",)):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOROVOD_SPARSE_GPU", "CUDA_HOME", "PYTHONPATH", "LDFLAGS")}
    env.update(HOROVOD_SPARSE_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable,
               INSTALL_LOG=str(tmp_path / "install.log"))
    if gpu is not None:
        env["HOROVOD_SPARSE_GPU"] = gpu
    if path is not None:
        env["PATH"] = path
    env.update(extra or {})
    return subprocess.run(["bash", script, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def plan(proc):
    """--print-plan's output: (flavour, cache folder, settings as a dict)."""
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("flavour: ") and lines[1].startswith("cache: "), proc.stdout
    settings = dict(line.split("=", 1) for line in lines[2:])
    return lines[0][len("flavour: "):], lines[1][len("cache: "):], settings


@pytest.mark.parametrize("gpu", [None, "", "0"])
def test_cpu_flavour_builds_as_before(tmp_path, gpu):
    flavour, cache, settings = plan(run(BUILD, tmp_path, gpu=gpu))
    assert flavour == "mpi-gloo"
    assert os.path.basename(cache) == "horovod-0.28.1-mpi-gloo-torch2.13.0-tf2.21.0"
    assert os.path.dirname(cache) == str(tmp_path / "cache")
    assert [f"{k}={v}" for k, v in settings.items()] == CPU_SETTINGS


def test_gpu_flavour_adds_nccl_and_keys_its_own_cache(tmp_path):
    cuda, nccl = fake_toolkit(tmp_path), fake_nccl(tmp_path)
    flavour, cache, settings = plan(run(BUILD, tmp_path, gpu="1",
                                        path=f"{cuda / 'bin'}{os.pathsep}{path_without_nvcc()}",
                                        extra={"PYTHONPATH": str(tmp_path / "site")}))
    assert flavour == "nccl-mpi-gloo"
    assert os.path.basename(cache) == "horovod-0.28.1-nccl-mpi-gloo-torch2.13.0-tf2.21.0"
    _, cpu_cache, _ = plan(run(BUILD, tmp_path))
    assert cache != cpu_cache  # neither flavour finds the other's wheel
    for setting in CPU_SETTINGS:  # MPI and Gloo as in the CPU flavour
        key, value = setting.split("=")
        assert settings[key] == value
    assert settings["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert settings["HOROVOD_CUDA_HOME"] == str(cuda)
    assert settings["HOROVOD_NCCL_HOME"] == str(nccl)
    assert settings["HOROVOD_NCCL_LINK"] == "SHARED"
    assert settings["LDFLAGS"] == f"-Wl,-rpath,{nccl / 'lib'}"


def test_gpu_flavour_takes_cuda_home_before_path(tmp_path):
    cuda = fake_toolkit(tmp_path)
    fake_nccl(tmp_path)
    _, _, settings = plan(run(BUILD, tmp_path, gpu="1", path=path_without_nvcc(),
                              extra={"CUDA_HOME": str(cuda), "PYTHONPATH": str(tmp_path / "site")}))
    assert settings["HOROVOD_CUDA_HOME"] == str(cuda)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH here")
def test_gpu_flavour_finds_the_toolkit_behind_the_nvcc_on_path(tmp_path):
    """The nvcc on PATH may be a link or a wrapper script: the toolkit is where nvcc says it is."""
    fake_nccl(tmp_path)
    _, _, settings = plan(run(BUILD, tmp_path, gpu="1", extra={"PYTHONPATH": str(tmp_path / "site")}))
    home = settings["HOROVOD_CUDA_HOME"]
    assert os.path.isfile(os.path.join(home, "bin", "nvcc")), home
    version = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True, timeout=60)
    assert "Cuda compilation tools" in version.stdout


@pytest.mark.parametrize("args", [("--print-plan",), ("--cached",), ()])
def test_gpu_flavour_without_nvcc_fails_naming_it(tmp_path, args):
    """The real case on a machine without the CUDA toolkit: a clear error, nothing fetched or made."""
    proc = run(BUILD, tmp_path, gpu="1", path=path_without_nvcc(), args=args)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "needs the CUDA toolkit's compiler, nvcc, and found none (not on PATH)" in proc.stderr
    assert "CUDA_HOME" in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_gpu_flavour_with_a_cuda_home_lacking_nvcc_names_it(tmp_path):
    proc = run(BUILD, tmp_path, gpu="1", path=path_without_nvcc(), extra={"CUDA_HOME": str(tmp_path)})
    assert proc.returncode == 1
    assert f"not {tmp_path}/bin/nvcc from CUDA_HOME" in proc.stderr


def test_gpu_flavour_without_pip_nccl_fails_naming_it(tmp_path):
    cuda = fake_toolkit(tmp_path)
    proc = run(BUILD, tmp_path, gpu="1", path=f"{cuda / 'bin'}{os.pathsep}{path_without_nvcc()}")
    assert proc.returncode == 1
    assert "no NCCL in" in proc.stderr and "nvidia-nccl-cu13" in proc.stderr


def test_a_switch_that_is_neither_0_nor_1_is_refused(tmp_path):
    proc = run(BUILD, tmp_path, gpu="yes")
    assert proc.returncode == 2
    assert "HOROVOD_SPARSE_GPU is 'yes'; it must be 1" in proc.stderr


def test_gpu_install_stops_at_its_first_step_without_nvcc(tmp_path):
    """install.sh checks the toolkit before Open MPI, pip or the build: one failed line, nothing else."""
    proc = run(INSTALL, tmp_path, gpu="1", path=path_without_nvcc(), args=())
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [proc.stdout.splitlines()[0]]
    assert proc.stdout.startswith("[install] CUDA toolkit (nvcc) ... FAILED (exit status 1,")
    assert "found none (not on PATH)" in proc.stderr
    assert "Open MPI" not in (tmp_path / "install.log").read_text()


@pytest.mark.parametrize("make_args, switch", [(["GPU=1"], "HOROVOD_SPARSE_GPU=1 "),
                                               ([], "HOROVOD_SPARSE_GPU= ")])
def test_make_install_passes_the_switch_on(make_args, switch):
    if shutil.which("make") is None:
        pytest.skip("no make here")
    env = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_SPARSE_GPU", "GPU")}
    proc = subprocess.run(["make", "-n", "-C", ROOT, "install", *make_args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"{switch}bash scripts/install.sh" in proc.stdout
