#!/usr/bin/env bash
# Builds torchvision without its compiled ops, for the CPU-only torch in .venv, and prints the wheel's path.
#
# Why: the registry's torchvision wheel is the CUDA build. Its _C.so needs libtorch_cuda.so and
# libc10_cuda.so, which torch+cpu does not ship, so its ops never load; 0.28.0's
# _meta_registrations.py then fails at import on its two unguarded
# register_fake("torchvision::nms" / "qnms") ("operator torchvision::nms does not exist",
# pytorch/vision#9085). The CPU build is not on the registry and torchvision publishes no sdist
# there, so neither can be installed here.
# What: from the registry wheel, drop the compiled parts (_C.so, image.so, the bundled CUDA /
# image codec libraries), guard those two register_fake calls with _has_ops() as every other
# registration in that file already is (the fix proposed upstream in pytorch/vision#9086),
# version it $TORCHVISION_VERSION+noops, and repack it as a pure-Python wheel (wheel pack writes RECORD).
# Models, transforms and datasets are pure Python and unchanged; torchvision.ops' compiled ops
# (nms, roi_align, ...) raise torchvision's own "Couldn't load custom C++ ops".
# The wheel is cached outside the repo like Horovod's (scripts/build_horovod.sh); the build takes seconds.
# Usage: scripts/build_torchvision.sh   (uses .venv/bin/python; all logs go to stderr)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/versions.sh
PY=${PYTHON:-.venv/bin/python}

cache=${HOROVOD_SPARSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod_sparse}/torchvision-$TORCHVISION_VERSION-noops
if ls "$cache"/torchvision-*.whl >/dev/null 2>&1; then
    ls "$cache"/torchvision-*.whl | head -n1
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[build_torchvision] downloading torchvision==$TORCHVISION_VERSION" >&2
$PY -m pip download -q --no-deps --only-binary :all: "torchvision==$TORCHVISION_VERSION" -d "$work/in" >&2
$PY -m wheel unpack -d "$work/tree" "$work"/in/torchvision-*.whl >&2
src=$work/tree/torchvision-$TORCHVISION_VERSION

echo "[build_torchvision] removing the compiled ops, guarding register_fake" >&2
rm -rf "$src"/torchvision/*.so "$src"/torchvision.libs
$PY - "$src/torchvision/_meta_registrations.py" <<'EOF'
import re, sys
path = sys.argv[1]
text = open(path).read()
text, n = re.subn(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$',
                  r'@_register_fake_if_has_ops("torchvision::\1")', text, flags=re.M)
assert n == 2, f"expected the 2 unguarded register_fake calls of 0.28.0, found {n}"
helper = """

def _register_fake_if_has_ops(qualname):
    # built without compiled ops (horovod_sparse scripts/build_torchvision.sh): the op does not exist
    def wrapper(fn):
        if torchvision.extension._has_ops():
            torch.library.register_fake(qualname)(fn)
        return fn

    return wrapper
"""
anchor = "\n\n@register_meta("  # the first use, right after register_meta's definition
i = text.index(anchor)
open(path, "w").write(text[:i] + helper + text[i:])
EOF

local=$TORCHVISION_VERSION+noops
sed -i "s/^__version__ = .*/__version__ = '$local'/" "$src/torchvision/version.py"
sed -i "s/^Version: .*/Version: $local/" "$src/torchvision-$TORCHVISION_VERSION.dist-info/METADATA"
sed -i 's/^Root-Is-Purelib: .*/Root-Is-Purelib: true/; s/^Tag: .*/Tag: py3-none-any/' \
    "$src/torchvision-$TORCHVISION_VERSION.dist-info/WHEEL"
mv "$src/torchvision-$TORCHVISION_VERSION.dist-info" "$src/torchvision-$local.dist-info"

mkdir -p "$work/dist" "$cache"
$PY -m wheel pack -d "$work/dist" "$src" >&2
cp "$work"/dist/torchvision-*.whl "$cache"/
ls "$cache"/torchvision-*.whl | head -n1
