#!/usr/bin/env bash
# Installs everything horovod_sparse needs, idempotently:
#   1. Open MPI from Debian (when mpirun is missing),
#   2. a virtualenv at .venv with pinned torch / TensorFlow / mpi4py / numba / test tools,
#   3. Horovod 0.28.1 built from its sdist with MPI and Gloo (patched, cached wheel; scripts/build_horovod.sh),
#   4. torchvision for the workloads' ResNet-18, without its compiled ops (cached wheel;
#      scripts/build_torchvision.sh says why),
#   5. this package in editable mode,
# then checks that Horovod's build lists MPI, Gloo, PyTorch and TensorFlow (as horovodrun --check-build would).
# HOROVOD_SPARSE_GPU=1 (make install GPU=1) installs the GPU flavour (scripts/versions.sh): first
# checks that the CUDA toolkit is there, then takes torch's CUDA wheel, tensorflow and pip's NCCL,
# builds Horovod with NCCL operations too, and checks that its build lists NCCL as well.
# A second run with a warm cache takes seconds.
# It prints one line per step with its time; the full output of every step goes to
# results/install.log, and a failing step's output is shown in full (scripts/install_steps.sh).
# VERBOSE=1 (make install V=1) streams everything as it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
source scripts/install_steps.sh
PY=.venv/bin/python
steps_begin

# -- 0. the CUDA toolkit (GPU flavour only: before anything is downloaded) ----
if gpu_flavour; then
    step "CUDA toolkit (nvcc)" cuda_home
fi

# -- 1. Open MPI -------------------------------------------------------------
have_mpi() { command -v mpirun && command -v mpicc; }
install_mpi() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "error: Open MPI is missing and this is not root."
        echo "       install it first:  sudo apt-get install -y openmpi-bin libopenmpi-dev"
        return 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev
}
step "Open MPI" --skip-if have_mpi install_mpi

# -- 2. virtualenv -----------------------------------------------------------
have_venv() { [ -x .venv/bin/python ]; }
step "virtualenv .venv" --skip-if have_venv python3 -m venv .venv

# (the GPU flavour's packages and name join the stamp's key; the CPU flavour's key is as it was)
stamp_key="$TORCH_VERSION $TF_VERSION $TF_KERAS_VERSION $MPI4PY_VERSION $NUMBA_VERSION $(cat requirements-dev.txt)"
gpu_flavour && stamp_key+=" $HOROVOD_FLAVOUR ${GPU_PACKAGES[*]}"
stamp=.venv/.deps-$(printf '%s' "$stamp_key" | sha1sum | cut -c1-12)
have_deps() { [ -f "$stamp" ]; }
# The installed dependencies are kept once per key outside the repo, as Horovod's wheel is, and a
# new venv (a fresh clone's: CI's) takes them as hard links in seconds instead of pip's minute and
# more; a venv that holds other packages (a pin changed) goes through pip, which keeps them.
deps_cache=${HOROVOD_SPARSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod_sparse}/deps-$(python3 -c 'import sys; print("py%d.%d" % sys.version_info[:2])')-${stamp#.venv/.deps-}
# (a venv that holds nothing but pip: one this script made, or a cache run cut short)
fresh_venv() {
    local others
    ! ls .venv/.deps-* >/dev/null 2>&1 || return 1
    others=$($PY -m pip list --format=freeze 2>/dev/null | grep -vE '^(pip|setuptools|wheel)==') || true
    [ -z "$others" ]
}
cached_deps_fit() { [ -f "$deps_cache/complete" ] && fresh_venv; }
site_packages() { $PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
install_deps() {
    local fresh=
    if fresh_venv; then fresh=1; fi
    if [ -n "$fresh" ] && [ -f "$deps_cache/complete" ] && link_cached_deps; then
        echo "linked from $deps_cache"
    else
        pip_install_deps
        # (a fresh venv's only: it holds the dependencies and nothing else)
        if [ -n "$fresh" ]; then save_deps_to_cache || echo "the dependencies were not kept in $deps_cache"; fi
    fi
    if gpu_flavour; then check_torch_cuda; fi
    rm -f .venv/.checked-*
    touch "$stamp"
}
pip_install_deps() {
    $PY -m pip install -q --upgrade pip setuptools wheel
    if gpu_flavour; then drop_cpu_wheels; fi
    # (--no-compile, then compileall on every core, 50 s on 2 here: pip would byte-compile in one
    # process; the byte code goes into the cache with the rest, so a venv that links it compiles
    # nothing. A file that does not compile, as with pip, is left to the import)
    $PY -m pip install -q --no-compile "torch==$TORCH_VERSION" "$TF_PACKAGE==$TF_VERSION" \
        "tf-keras==$TF_KERAS_VERSION" "mpi4py==$MPI4PY_VERSION" \
        "numba==$NUMBA_VERSION" -r requirements-dev.txt "${GPU_PACKAGES[@]}"
    $PY -m compileall -q -j 0 "$(site_packages)" || true
}
# (site-packages and the console scripts, into a folder renamed into place once whole: a run cut
# short leaves no cache that looks complete; hard links only, as link_cached_deps takes them: a
# copy on another file system could never be linked back, only fill the disk)
save_deps_to_cache() {
    local tmp
    tmp=$(dirname "$deps_cache")/.partial-$$
    rm -rf "$tmp" "$deps_cache" && mkdir -p "$tmp/bin" || return 0
    if cp -al "$(site_packages)" "$tmp/site-packages" 2>/dev/null; then
        find .venv/bin -maxdepth 1 -type f ! -iname 'activate*' -exec cp -a {} "$tmp/bin/" \;
        readlink -f .venv/bin/python >"$tmp/python"
        touch "$tmp/complete" && mv "$tmp" "$deps_cache" && echo "kept in $deps_cache"
    else
        rm -rf "$tmp"; echo "not kept: $(dirname "$deps_cache") is not on this venv's file system"
    fi
}
# (hard links where the cache is on this venv's file system; its console scripts get this venv's
# python in their first line)
link_cached_deps() {
    local site script
    [ "$(readlink -f .venv/bin/python)" = "$(cat "$deps_cache/python")" ] || return 1
    site=$(site_packages) || return 1
    rm -rf "$site.linking" || return 1
    cp -al "$deps_cache/site-packages" "$site.linking" 2>/dev/null || { rm -rf "$site.linking"; return 1; }
    rm -rf "$site" && mv "$site.linking" "$site" || return 1
    for script in "$deps_cache"/bin/*; do
        sed "1s|^#!.*python[0-9.]*\$|#!$PWD/.venv/bin/python|" "$script" >".venv/bin/${script##*/}" || return 1
        chmod +x ".venv/bin/${script##*/}" || return 1
    done
}
# A venv from the CPU flavour holds torch+cpu and tensorflow-cpu, which pip counts as meeting the
# pins: remove them, and the tensorflow whose files tensorflow-cpu's overwrote, so the GPU wheels go in.
drop_cpu_wheels() {
    if $PY -c "import importlib.metadata as m, sys; sys.exit('+cpu' not in m.version('torch'))" 2>/dev/null; then
        $PY -m pip uninstall -y -q torch
    fi
    if $PY -m pip show -q tensorflow-cpu 2>/dev/null; then
        $PY -m pip uninstall -y -q tensorflow-cpu tensorflow
    fi
}
# pip takes a CPU-only torch where its configuration names one (a find-links folder, the +cpu index)
check_torch_cuda() {
    $PY -c "import torch, sys; sys.exit(torch.version.cuda is None)" || {
        echo "error: torch $($PY -c 'import torch; print(torch.__version__)') has no CUDA (torch.version.cuda is None):"
        echo "       pip took a CPU-only wheel, from a find-links folder or a +cpu index in its configuration"
        echo "       (pip config list). Install torch==$TORCH_VERSION from PyPI's default index into .venv, then rerun."
        return 1
    }
}
label="pinned dependencies into .venv"
if ! have_deps; then
    if cached_deps_fit; then label+=" (linked from the cache)"; else label+=" (torch, TensorFlow, ...: several minutes)"; fi
fi
step "$label" --skip-if have_deps install_deps

# -- 3. Horovod --------------------------------------------------------------
# (the stamp names the build's flavour: a venv holding an older build, without Gloo say, is rebuilt)
horovod_stamp=.venv/.horovod-$HOROVOD_VERSION-$HOROVOD_FLAVOUR
have_horovod() {
    [ -f "$horovod_stamp" ] && $PY -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')"
}
install_horovod() {
    local wheel
    wheel=$(scripts/build_horovod.sh)
    echo "installing $wheel"
    # its dependencies first: a run that fails after the wheel would find Horovod "present"
    $PY -m pip install -q cloudpickle psutil pyyaml packaging
    $PY -m pip install -q --no-deps --force-reinstall "$wheel"
    rm -f .venv/.horovod-* .venv/.checked-*
    touch "$horovod_stamp"
}
label="Horovod $HOROVOD_VERSION"
gpu_flavour && label+=" with NCCL"
if ! have_horovod 2>/dev/null; then
    if scripts/build_horovod.sh --cached >/dev/null 2>&1; then label+=" (cached wheel)"
    else label+=" (building the wheel: about 8 minutes)"; fi
fi
step "$label" --skip-if have_horovod install_horovod

# -- 4. torchvision ----------------------------------------------------------
# (the metadata check is the stamp: no torch import, so a second run stays fast)
tv_want=$TORCHVISION_VERSION+noops
have_torchvision() { $PY -c "import importlib.metadata as m, sys; sys.exit(m.version('torchvision') != '$tv_want')"; }
install_torchvision() {
    local wheel
    wheel=$(scripts/build_torchvision.sh)
    echo "installing $wheel"
    # its dependencies (torch==$TORCH_VERSION, numpy, pillow) are already here: torch's +cpu build satisfies ==
    $PY -m pip install -q "$wheel"
    rm -f .venv/.checked-torchvision-*
}
step "torchvision $tv_want" --skip-if have_torchvision install_torchvision

# -- 5. this package ---------------------------------------------------------
# (checked from / so that the checkout itself on sys.path does not count as installed;
# setup.py's hash in the stamp reinstalls when its entry points or package data change)
pkg_stamp=.venv/.pkg-$(sha1sum setup.py | cut -c1-12)
have_package() { [ -f "$pkg_stamp" ] && (cd / && "$OLDPWD/$PY" -c "import horovod_sparse"); }
install_package() {
    $PY -m pip install -q --no-deps --no-build-isolation -e .
    rm -f .venv/.pkg-*
    touch "$pkg_stamp"
}
step "horovod_sparse (editable)" --skip-if have_package install_package

# -- checks ------------------------------------------------------------------
# (NCCL, for the GPU flavour, is listed among the tensor operations as [X] NCCL)
wants=(MPI Gloo PyTorch TensorFlow)
gpu_flavour && wants+=(NCCL)
# (Horovod's own flags, read in one process that imports both frameworks, about 10 s: `horovodrun
# --check-build` says the same but imports each framework in processes of its own, about 45 s here,
# and a fresh clone, as CI's, pays it every time; once per install of the dependencies or of Horovod,
# whose steps remove the stamp; a later run finds the stamp and says "present")
printf -v wanted '%s, ' "${wants[@]}"
build_checked=.venv/.checked-$(printf '%s' "${wanted%, }" | sha1sum | cut -c1-12)
have_checked_build() { [ -f "$build_checked" ]; }
check_build() {
    local check want
    check=$(TF_CPP_MIN_LOG_LEVEL=3 TF_USE_LEGACY_KERAS=1 $PY - <<'PY'
import traceback
built = {}
for framework, module in [("PyTorch", "horovod.torch"), ("TensorFlow", "horovod.tensorflow")]:
    try:
        hvd = __import__(module, fromlist=["_"])
    except Exception:  # reported as missing below, with why
        traceback.print_exc()
        continue
    built[framework] = True
    for name, flag in [("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built()), ("NCCL", hvd.nccl_built())]:
        built[name] = built.get(name, True) and bool(flag)
for name in ["PyTorch", "TensorFlow", "MPI", "Gloo", "NCCL"]:
    print(f"[{'X' if built.get(name) else ' '}] {name}")
PY
    ) || true
    echo "$check"
    for want in "${wants[@]}"; do
        grep -q "\[X\] $want" <<<"$check" || {
            echo "error: Horovod's build does not list $want as available (horovodrun --check-build shows all)"; return 1; }
    done
    touch "$build_checked"
}
step "Horovod's build lists ${wanted%, }" --skip-if have_checked_build check_build
# (once per install of torchvision or of what it runs on, as the build check: about 6 s a run otherwise)
tv_checked=.venv/.checked-torchvision-$tv_want
have_checked_torchvision() { [ -f "$tv_checked" ]; }
check_torchvision() {
    $PY -c "import torchvision.models; torchvision.models.resnet18(num_classes=10)" || {
        echo "error: torchvision does not import with this torch"; return 1; }
    touch "$tv_checked"
}
step "torchvision imports, builds a ResNet-18" --skip-if have_checked_torchvision check_torchvision
built="MPI, Gloo, PyTorch and TensorFlow"
gpu_flavour && built="NCCL (GPU), $built"
steps_end "ok: Horovod $HOROVOD_VERSION with $built, torchvision $tv_want in .venv"
