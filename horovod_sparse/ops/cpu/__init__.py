"""Compiled CPU kernels: a pipeline's hot passes fused into one loop each.

With numpy (or torch on a CPU) every operation is a pass over the gradient of its own,
often with a temporary buffer: error feedback, the magnitude keys, a comparison, a
compaction, the overflow check are five passes over 100 MB where one would do. The
kernels of this package do several operations per element while it is in registers, and
are compiled for this CPU by numba (LLVM), one thread each (the ranks already fill the
cores), without the GIL (the schedules' channel threads run them side by side).

One module per family, beside the numpy code it replaces:

* :mod:`.memory`: error feedback (or Signum's momentum, or a copy) + the overflow check, in
  one pass: the quantizers', PowerSGD's and the FFT's first pass;
* :mod:`.sparsify`: error feedback (or DGC's momentum correction) + the overflow check +
  the candidates at or above a key, in one pass; the top-k among the candidates;
* :mod:`.quantize`: the sign codes' fixed-order sums, and their encode writing the next
  residual in the same pass; QSGD's and TernGrad's levels;
* :mod:`.lowrank`: PowerSGD's result and residual;
* :mod:`.spectrum`: the FFT's energy keys from the spectrum;
* :mod:`.cast`: random-k's error feedback, gather and zeroing; a dense result from sorted
  (index, value) pairs (zeros and values in one sequential pass).

The numpy code stays the oracle and the fallback: callers take it when numba is not
installed, when ``HOROVOD_SPARSE_KERNELS=numpy`` is set, or inside ``with numpy_only():``.
Both give the same bits: integer keys, and per element the same float32 operations in
the same order (no fast-math, no reassociation).

``HOROVOD_SPARSE_KERNELS=torch`` (or ``with device_path():``) is the GPU's path on the CPU:
CPU torch tensors then run torch's own ops, exactly the code a CUDA tensor runs (no numpy
view, no compiled kernel), while numpy arrays keep numpy's (the oracle). Callers ask
:func:`horovod_sparse.ops.namespace.host_shortcut_allowed` rather than this module.

Example::

    from horovod_sparse.ops import cpu
    if cpu.enabled():          # numba is here and not turned off
        ...
    with cpu.numpy_only():     # the reference path, e.g. in a test
        ...
    with cpu.device_path():    # CPU tensors run what a CUDA tensor runs
        ...
"""
import contextlib
import threading

from horovod_sparse import switches

#: the environment variable that chooses the kernels (:mod:`horovod_sparse.switches`)
KERNELS_ENV = switches.KERNELS
CHOICES = switches.CHOICES[KERNELS_ENV]

try:
    import numba
except ImportError:  # the numpy path serves
    numba = None

_local = threading.local()  # the blocks' choice is per thread: a test's switch never leaks into a channel thread's step


def chosen():
    """The kernels in force in this thread: the innermost :func:`numpy_only` / :func:`device_path`
    block's, else the environment's (one of :data:`CHOICES`)."""
    choice = getattr(_local, "choice", None)
    if choice is not None:
        return choice
    return switches.read(KERNELS_ENV)


def available():
    """Whether numba is installed (the compiled kernels can run)."""
    return numba is not None


def enabled():
    """Whether callers should run the compiled kernels now: numba is installed and the kernels
    in force (:func:`chosen`) are numba's."""
    return numba is not None and chosen() == "numba"


def device_path_chosen():
    """Whether CPU torch tensors run the device's code now (``torch`` in force)."""
    return chosen() == "torch"


@contextlib.contextmanager
def _choosing(choice):
    before = getattr(_local, "choice", None)
    _local.choice = choice
    try:
        yield
    finally:
        _local.choice = before


def numpy_only():
    """Within the block (this thread), every caller takes the numpy path."""
    return _choosing("numpy")


def device_path():
    """Within the block (this thread), CPU torch tensors run torch's own ops, as a CUDA tensor
    does; numpy arrays run numpy's (no compiled kernels): ``HOROVOD_SPARSE_KERNELS=torch``."""
    return _choosing("torch")


def jit(function):
    """``function`` compiled by numba: no Python objects, no GIL, cached on disk (the first call
    of a signature compiles it, once per machine), IEEE arithmetic (no fast-math). Without
    numba, the plain Python function (callers check :func:`enabled` first and never run it)."""
    if numba is None:
        return function
    return numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy")(function)


def inlined(function):
    """Like :func:`jit`, for a helper that kernels call: compiled into each caller (numba does
    not inline a call to another compiled function by itself, and the call costs the caller
    its vectorised loop: 19 against 13 ms for the sparsifiers' pass over 25M entries)."""
    if numba is None:
        return function
    return numba.njit(cache=True, nogil=True, fastmath=False, error_model="numpy", inline="always")(function)


def _bit_intrinsics():
    """``cttz(x)``, the index of the lowest set bit of a non-zero uint64, and ``popcount(x)``, how
    many bits are set: one instruction each (LLVM's cttz and ctpop). How a kernel visits, or
    counts, the marked entries of a 64-entry block."""
    if numba is None:
        return None, None
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    @intrinsic
    def cttz(typingctx, x):
        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.cttz", [i64], ir.FunctionType(i64, [i64, ir.IntType(1)]))
            return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])
        return types.uint64(types.uint64), codegen

    @intrinsic
    def popcount(typingctx, x):
        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.ctpop", [i64], ir.FunctionType(i64, [i64]))
            return builder.call(fn, [args[0]])
        return types.uint64(types.uint64), codegen
    return cttz, popcount


cttz, popcount = _bit_intrinsics()


def _mask_intrinsic():
    """``negative_bits64(x, start)``: a uint64 with bit b set where x[start + b] < 0, for a
    C-contiguous float32 ``x`` holding start + 64 values. One vector load, one ordered compare
    (NaN and -0 give 0, as numpy's ``x < 0``) and the 64 results taken as the bits of an
    integer: LLVM's movemask (or AVX-512's mask register), where a loop of 64 shifts and ORs
    stays scalar. How the sign codes pack their bits (``studies/time_kernels.py``)."""
    if numba is None:
        return None
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    lanes = 64

    @intrinsic
    def negative_bits64(typingctx, x, start):
        if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"):
            return None  # a typing error: only contiguous float32 vectors

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            first = cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])
            vector = ir.VectorType(ir.FloatType(), lanes)
            values = builder.load(builder.bitcast(first, vector.as_pointer()), align=4)
            negative = builder.fcmp_ordered("<", values, ir.Constant(vector, [0.0] * lanes))
            return builder.bitcast(negative, ir.IntType(lanes))
        return types.uint64(x, start), codegen
    return negative_bits64


negative_bits64 = _mask_intrinsic()


def _word_intrinsics():
    """``store_le64(out, at, word)``: bytes out[at:at + 8] of a C-contiguous uint8 ``out`` =
    ``word``, least significant byte first (numba's targets are little-endian), in one unaligned
    8-byte store: LLVM does not merge eight byte stores into one (QSGD's and TernGrad's 8-code
    groups). ``load_le64(data, at)``: bytes data[at:at + 8] as one uint64, the same way round."""
    if numba is None:
        return None, None
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    @intrinsic
    def store_le64(typingctx, out, at, word):
        if not (isinstance(out, types.Array) and out.dtype == types.uint8 and out.ndim == 1 and out.layout == "C"):
            return None  # a typing error: only contiguous byte vectors

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            first = cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])
            value = context.cast(builder, args[2], signature.args[2], types.uint64)
            builder.store(value, builder.bitcast(first, i64.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.none(out, at, word), codegen

    @intrinsic
    def load_le64(typingctx, data, at):
        if not (isinstance(data, types.Array) and data.dtype == types.uint8 and data.ndim == 1
                and data.layout == "C"):
            return None

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            first = cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])
            return builder.load(builder.bitcast(first, i64.as_pointer()), align=1)
        return types.uint64(data, at), codegen
    return store_le64, load_le64


store_le64, load_le64 = _word_intrinsics()
