"""The quantizers' compiled kernels (horovod_sparse.ops.cpu.quantize) against numpy, bit for bit.

Kernel level: the memory's acc and overflow flag, the tree sums, every codec's encode (code
bytes, decoded floats, residual) and decode equal the numpy path (``cpu.numpy_only()``) on
random and adversarial inputs (zeros of both signs, denormals, level ties, inf/NaN), odd
lengths, n = 0 and 1, buffers not aligned. Pipeline level: every quantizer, several steps, on
numpy arrays and CPU tensors, gives the same outputs and state with the kernels on and off, an
overflowed step changing nothing either way.
"""
import contextlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

import horovod_sparse
import kernel_inputs
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.ops import cpu
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.codecs import (OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec, TernGradCodec,
                                            _StochasticLevels)
from horovod_sparse.quantize.onebit_buckets import BucketedOneBitCodec
from horovod_sparse.quantize.scratch import Scratch
from kernel_inputs import unaligned
from horovod_sparse.quantize.sums import tree_sum_rows

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
fused = pytest.importorskip("horovod_sparse.ops.cpu.quantize")
memory_kernels = pytest.importorskip("horovod_sparse.ops.cpu.memory")

LENGTHS = [0, 1, 7, 63, 65, 513, 1000, 100003]
KINDS = ["normal", "ties", "zeros", "denormals", "nonfinite"]
# 8-bit codes (s = 64 .. 127) take the kernels' byte-per-code path: default buckets, odd ones (a
# bucket starting at an odd stream index), and one bucket larger than the block of the norm
CODECS = [QSGDCodec(), QSGDCodec(levels=1, bucket_size=7), QSGDCodec(levels=2 ** 15 - 1, bucket_size=3),
          QSGDCodec(levels=40, bucket_size=1000), QSGDCodec(levels=5, bucket_size=1), TernGradCodec(),
          QSGDCodec(levels=127), QSGDCodec(levels=64, bucket_size=3), QSGDCodec(levels=127, bucket_size=2 ** 31 - 1),
          SignCodec(), ScaledSignCodec(), OneBitCodec(),
          # int4: the levels' kernels rounding to nearest
          Int4Codec(), Int4Codec(bits=3, bucket_size=7), Int4Codec(bits=2, bucket_size=1000),
          # 1 bit over buckets: on words of bits (256), value by value (7), both (100: some start on a word)
          BucketedOneBitCodec(), BucketedOneBitCodec(7), BucketedOneBitCodec(100)]


@pytest.fixture(autouse=True)
def levels_kernels_on(monkeypatch):
    """On here whatever the codecs' default, so that the kernels are tested."""
    monkeypatch.setattr(_StochasticLevels, "fused_cpu", True)


def same(a, b):
    """Bitwise equality of two arrays (NaN payloads and -0 included)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def adversarial(n, rng, kind):
    """float32 vectors that stress the codes: level ties (the scale's multiples), zeros of both
    signs, denormals, overflows."""
    return kernel_inputs.adversarial(n, rng, kind, ties=(-1.0, 1.0, 0.5, -0.5, 0.25, -0.0, 0.0), scale=3.0)


def assert_same_records(reference, run):
    """Two runs' step records (outputs, states, refusals) equal, bit for bit."""
    assert len(run) == len(reference)
    for a, b in zip(reference, run):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        elif isinstance(a, np.ndarray):
            assert same(a, b)
        else:
            assert a == b


def both(function):
    """(numpy path's result, kernels' result) of ``function()``."""
    with cpu.numpy_only():
        reference = function()
    return reference, function()


# ----------------------------------------------------------------- kernels
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_accumulate_and_overflow_flag_equal_numpy(n, kind):
    """The memory's first passes (horovod_sparse.ops.cpu.memory) against numpy's two passes."""
    rng = np.random.default_rng(n)
    grad, state = unaligned(adversarial(n, rng, kind)), adversarial(n, rng, kind)
    acc = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        expected = grad + state
        finite = all_finite(expected)
    assert memory_kernels.accumulate_finite(grad, state, acc) == finite
    assert same(acc, expected)
    out = np.empty(n, np.float32)
    with np.errstate(all="ignore"):
        expected = state * np.float32(0.9)
        expected += grad
        finite = all_finite(expected)
    assert memory_kernels.momentum_finite(grad, state, np.float32(0.9), out) == finite
    assert same(out, expected)
    assert memory_kernels.copy_finite(grad, out) == all_finite(grad) and same(out, grad)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 255, 1023, 1024, 1025, 4097, 100003, 1000003])
@pytest.mark.parametrize("kind", KINDS)
def test_tree_sums_equal_numpy_tree(n, kind):
    x = unaligned(adversarial(n, np.random.default_rng(n), kind))
    sums, _ = fused.tree_sums(x, 0, Scratch())
    assert same(sums[:1], tree_sum_rows(np.abs(x).reshape(1, -1)))
    sums, negatives = fused.tree_sums(x, 1, Scratch())
    assert same(sums, tree_sum_rows(np.stack([np.clip(x, 0, None), np.clip(x, None, 0)])))
    assert negatives == np.count_nonzero(x < 0)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_encode_decode_residual_equal_numpy(codec, n, kind):
    x = unaligned(adversarial(n, np.random.default_rng(n + 1), kind))

    def run():
        decoded, residual = np.empty(n, np.float32), np.empty(n, np.float32)
        code = codec.encode(x, seed=7, decoded=decoded, residual=residual)
        return code, decoded, residual, codec.decode(unaligned_bytes(code), n)

    reference, compiled = both(run)
    for a, b in zip(reference, compiled):
        assert same(a, b)
    with np.errstate(all="ignore"):
        assert same(reference[2], x - reference[1])


@pytest.mark.parametrize("codec", [c for c in CODECS if isinstance(c, _StochasticLevels)], ids=repr)
@pytest.mark.parametrize("n", [1, 9, 2047, 2049, 4103])
def test_packed_codes_end_where_the_code_ends(codec, n):
    """The narrow codes' 8-byte stores (each group's spare bytes overwritten by the next group)
    leave the bytes past the code as they were, in a larger buffer at an odd address."""
    x = adversarial(n, np.random.default_rng(n), "normal")
    size = codec.nbytes(n)
    reference = codec.encode(x, seed=3)
    buffer = np.full(size + 24, 0xA5, np.uint8)
    code = codec.encode(x, seed=3, out=buffer[1:1 + size])
    assert same(code, reference) and same(buffer[1:1 + size], reference)
    assert buffer[0] == 0xA5 and (buffer[1 + size:] == 0xA5).all()


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_sum_of_two_codes_equals_the_sum_of_their_decodes(codec, n, kind):
    """The compressed allreduce's P = 2 sum of two codes (a 1-bit code's in one compiled pass, the
    levels' by two decodes and an add): the kernels, the numpy path and numpy's own
    decode(first) + decode(second) give the same bits."""
    rng = np.random.default_rng(n + 5)
    first, second = (unaligned_bytes(codec.encode(adversarial(n, rng, kind), seed=1)) for _ in range(2))
    reference, compiled = both(lambda: codec.decode_sum_of_two(first, second, n, out=unaligned(np.empty(n, np.float32))))
    with cpu.numpy_only(), np.errstate(all="ignore"):
        oracle = codec.decode(first, n) + codec.decode(second, n)
    tensor = codec.decode_sum_of_two(torch.from_numpy(first.copy()), torch.from_numpy(second.copy()), n)
    assert torch.is_tensor(tensor)
    for got in (compiled, reference, tensor.numpy()):
        if kind == "nonfinite":  # NaN + -NaN: which payload an add keeps is the instruction's choice
            assert same(np.isnan(got), np.isnan(oracle)) and same(got[~np.isnan(got)], oracle[~np.isnan(oracle)])
        else:                    # (and an overflowed step stops before the exchange)
            assert same(got, oracle)
    fused_here = isinstance(codec, SignCodec)  # the levels: two decodes and an add
    assert codec.sums_two_codes(np.empty(1, np.float32)) == codec.sums_two_codes(torch.empty(1)) == fused_here
    with cpu.numpy_only():
        assert not codec.sums_two_codes(np.empty(1, np.float32))


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_residual_without_decoded_floats(codec):
    """An encode asked for the residual alone (the exchange's chunks nobody decodes): both paths
    write x - decode(code), as when the decoded floats are asked for too."""
    x = adversarial(1001, np.random.default_rng(4), "normal")

    def run():
        residual = np.empty(1001, np.float32)
        return codec.encode(x, seed=5, residual=residual), residual

    reference, compiled = both(run)
    assert same(reference[0], compiled[0]) and same(reference[1], compiled[1])
    with cpu.numpy_only():
        assert same(reference[1], x - codec.decode(reference[0], 1001))


def unaligned_bytes(code):
    base = np.empty(code.size + 1, np.uint8)
    base[1:] = code
    return base[1:]


@pytest.mark.parametrize("codec", [QSGDCodec(), TernGradCodec(), OneBitCodec(), BucketedOneBitCodec()], ids=repr)
def test_residual_in_place_and_cpu_tensors(codec):
    """The residual may be the values themselves (the pipeline's spare); a CPU tensor runs the
    kernels on its numpy view: the same bytes."""
    x = adversarial(1001, np.random.default_rng(3), "normal")

    def run(values):
        decoded = torch.empty(1001) if torch.is_tensor(values) else np.empty(1001, np.float32)
        code = codec.encode(values, seed=3, decoded=decoded, residual=values)
        return np.asarray(code), np.asarray(decoded), np.asarray(values)

    reference = both(lambda: run(x.copy()))[0]
    for a, b in zip(reference, run(x.copy())):
        assert same(a, b)
    for a, b in zip(reference, run(torch.from_numpy(x.copy()))):
        assert same(a, b)


def test_terngrad_many_values_on_a_boundary():
    """TernGrad's levels where x * inv is exactly +-1 or 0: the noise decides, both paths alike."""
    x = np.tile(np.float32([1.0, -1.0, 0.0, -0.0, 0.5]), 2001)
    codec = TernGradCodec()
    reference, compiled = both(lambda: codec.encode(x, seed=11))
    assert same(reference, compiled)


# ---------------------------------------------------------------- pipeline
SPECS = ["qsgd", "qsgd:error_feedback=True", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
         "efsignsgd:method=allgather", "onebit:method=allgather", "terngrad:method=allgather", "onebit:bucket_size=64"]


def steps(spec, n, library, overflow_at=2):
    """Outputs and states of 4 steps of ``spec``'s pipeline; step ``overflow_at`` overflows."""
    rng = np.random.default_rng(n)
    records = []
    with horovod_sparse.create(spec).make_pipeline(n, MPI.COMM_SELF) as pipeline:
        for step in range(4):
            grad = rng.standard_normal(n).astype(np.float32)
            if step == overflow_at and n:
                grad[n // 2] = np.nan
            grad = torch.from_numpy(grad) if library == "torch" else unaligned(grad)
            try:
                records.append(np.asarray(pipeline.step(grad)).copy())
            except NonFiniteGradientError:
                records.append("overflow")
            records.append({k: np.atleast_1d(np.asarray(v)).copy() for k, v in pipeline.state_dict().items()})
            records.append(pipeline.step_count)
    return records


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("n", [1, 65, 1003])
def test_pipeline_steps_equal_numpy(spec, library, n):
    reference, compiled = both(lambda: steps(spec, n, library))
    assert_same_records(reference, compiled)
    assert any(isinstance(record, str) for record in reference)  # the overflowed step was refused


@pytest.mark.parametrize("spec", ["onebit", "signum", "qsgd"])
def test_overflow_leaves_state_unchanged(spec):
    """An overflowed step, kernels on: the same state as before it (residual, momentum, counter)."""
    n = 1000
    with horovod_sparse.create(spec).make_pipeline(n, MPI.COMM_SELF) as pipeline:
        pipeline.step(np.random.default_rng(0).standard_normal(n).astype(np.float32))
        before = pipeline.state_dict()
        grad = np.ones(n, np.float32)
        grad[5] = np.inf
        with pytest.raises(NonFiniteGradientError):
            pipeline.step(grad)
        after = pipeline.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert same(np.atleast_1d(np.asarray(before[key])), np.atleast_1d(np.asarray(after[key])))


def test_numpy_only_really_turns_the_kernels_off(monkeypatch):
    """Inside numpy_only the kernels are not called (the oracle above is the numpy code)."""
    def refuse(*args):
        raise AssertionError("a kernel ran under numpy_only")
    monkeypatch.setattr(fused, "sign_encode", refuse)
    monkeypatch.setattr(memory_kernels, "accumulate_finite", refuse)
    with cpu.numpy_only(), contextlib.ExitStack():
        steps("onebit", 100, "numpy")


@pytest.mark.parametrize("codec", [QSGDCodec(levels=40, bucket_size=2 ** 31 - 1), TernGradCodec()], ids=repr)
def test_one_bucket_longer_than_a_block(codec):
    """One bucket over several of the numpy path's blocks (its norm sums the blocks' trees)."""
    x = adversarial(300001, np.random.default_rng(5), "normal")

    def run():
        decoded = np.empty(x.size, np.float32)
        return codec.encode(x, seed=5, decoded=decoded), decoded

    reference, compiled = both(run)
    assert same(reference[0], compiled[0]) and same(reference[1], compiled[1])


# ------------------------------------------------------------------- pieces
PIECE_SPECS = ["qsgd", "qsgd:error_feedback=True", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
               "bf16", "onebit:method=allgather"]
PIECE_LAYOUTS = ["float32", "mixed", "unaligned", "one", "torch32", "torchbf16"]
PIECE_N = 1500


def _pieces_of(x, layout):
    """``x`` (float32 numpy) cut into the pieces of ``layout``, and the float32 buffer they stand for."""
    cuts = np.cumsum([1, 0, 63, 1000])
    if layout == "one":
        parts = [x.copy()]
    elif layout == "unaligned":
        parts = [unaligned(p) for p in np.split(x, cuts)]
    else:
        parts = [p.copy() for p in np.split(x, cuts)]
    if layout == "mixed":
        parts = [p.astype(np.float64 if i % 2 else np.float16) for i, p in enumerate(parts)]
    if layout.startswith("torch"):
        dtype = torch.bfloat16 if layout == "torchbf16" else torch.float32
        parts = [torch.from_numpy(p).to(dtype) for p in parts]
        return parts, torch.cat([p.float() for p in parts])
    return parts, np.concatenate([np.asarray(p, np.float32) for p in parts])


def piece_steps(spec, layout, as_pieces, overflow_at=2):
    """Outputs and states of 4 steps of ``spec``'s pipeline, fed pieces or their fused buffer;
    step ``overflow_at`` has an inf in the last piece (checked: the state unchanged)."""
    rng = np.random.default_rng(7)
    records = []
    with horovod_sparse.create(spec).make_pipeline(PIECE_N, MPI.COMM_SELF) as pipeline:
        assert pipeline.takes_pieces
        for step in range(4):
            grad = rng.standard_normal(PIECE_N).astype(np.float32)
            if step == overflow_at:
                grad[-3] = np.inf
            pieces, buffer = _pieces_of(grad, layout)
            before = pipeline.state_dict()
            try:
                out = pipeline.step(pieces if as_pieces else buffer)
                records.append(np.asarray(out.float() if isinstance(out, torch.Tensor) else out).copy())
            except NonFiniteGradientError:
                records.append("overflow")
                after = pipeline.state_dict()
                assert all(same(np.atleast_1d(np.asarray(before[k])), np.atleast_1d(np.asarray(after[k])))
                           for k in before)
            records.append({k: np.atleast_1d(np.asarray(v)).copy() for k, v in pipeline.state_dict().items()})
            records.append(pipeline.step_count)
    return records


@pytest.mark.parametrize("spec", PIECE_SPECS)
@pytest.mark.parametrize("layout", PIECE_LAYOUTS)
def test_pieces_equal_fused_buffer(spec, layout):
    """Pieces read where they are: the outputs and state of the fused float32 buffer, kernels on
    and off; an overflow in one piece refused with the state unchanged, the next step fine."""
    runs = []
    for kernels in (True, False):
        with contextlib.ExitStack() as stack:
            if not kernels:
                stack.enter_context(cpu.numpy_only())
            runs += [piece_steps(spec, layout, True), piece_steps(spec, layout, False)]
    reference = runs[-1]
    assert sum(isinstance(r, str) for r in reference) == 1 and isinstance(reference[-3], np.ndarray)
    for run in runs[:-1]:
        assert_same_records(reference, run)


@pytest.mark.parametrize("spec", ["qsgd", "signum", "onebit"])
def test_pieces_of_a_wrong_length_raise_exchange_error(spec):
    """Pieces of another total length, or a bad piece: ExchangeError as for a bad buffer; then fine."""
    from horovod_sparse.exchange import ExchangeError
    with horovod_sparse.create(spec).make_pipeline(10, MPI.COMM_SELF) as pipeline:
        for bad in ([np.ones(3, np.float32), np.ones(4, np.float32)], [np.ones(10, np.int32)],
                    [np.ones((2, 5), np.float32)], np.ones(7, np.float32)):
            with pytest.raises(ExchangeError):
                pipeline.step(bad)
        out = pipeline.step([np.ones(4, np.float32), np.ones(6, np.float32)])
        assert np.asarray(out).shape == (10,) and pipeline.step_count == 1


def test_no_pieces_for_an_empty_buffer():
    with horovod_sparse.create("onebit").make_pipeline(0, MPI.COMM_SELF) as pipeline:
        assert np.asarray(pipeline.step([])).shape == (0,)


@pytest.mark.parametrize("spec", ["efsignsgd", "signum", "signsgd"])
def test_float32_pieces_take_the_kernels(spec, monkeypatch):
    """Kernels on, float32 pieces: the per-piece fused kernels, not the memory's own pass."""
    from horovod_sparse import memory

    def refuse(*args):
        raise AssertionError("the memory's own pass ran")
    for cls in (memory.ErrorFeedback, memory.Momentum):
        monkeypatch.setattr(cls, "accumulate_pieces", refuse)
    with horovod_sparse.create(spec).make_pipeline(PIECE_N, MPI.COMM_SELF) as pipeline:
        pieces, _ = _pieces_of(np.ones(PIECE_N, np.float32), "float32")
        pipeline.step(pieces)


@pytest.mark.parametrize("spec", ["efsignsgd", "signum", "qsgd"])
def test_tensorflow_pieces_equal_the_buffer(spec):
    """Eager TensorFlow pieces: fused and run on the TensorFlow path, the buffer's bits."""
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(PIECE_N).astype(np.float32) for _ in range(2)]
    outs = []
    for as_pieces in (True, False):
        with horovod_sparse.create(spec).make_pipeline(PIECE_N, MPI.COMM_SELF) as pipeline:
            for grad in grads:
                parts = [tf.constant(p.astype(np.float16 if i == 1 else np.float32))
                         for i, p in enumerate(np.split(grad, [1, 1, 64]))]
                whole = tf.concat([tf.cast(p, tf.float32) for p in parts], axis=0)
                outs.append(np.asarray(pipeline.step(parts if as_pieces else whole)))
            outs.append(pipeline.state_dict())
    half = len(outs) // 2
    for a, b in zip(outs[:half], outs[half:]):
        if isinstance(a, dict):
            assert all(same(np.atleast_1d(a[k]), np.atleast_1d(b[k])) for k in a)
        else:
            assert same(a, b)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_result_buffer_is_reused_only_when_released(library):
    """A step's sum goes into the buffer of the step before once nothing refers to it (no fresh
    memory to zero per step); a result the caller keeps, or a view of it, is never overwritten."""
    pipeline = horovod_sparse.create("efsignsgd").make_pipeline(1003, MPI.COMM_SELF)
    wrap = torch.from_numpy if library == "torch" else (lambda a: a)
    grad = wrap(np.linspace(-1, 1, 1003, dtype=np.float32))
    kept = pipeline.step(grad)
    view, first = kept[10:], np.asarray(kept).copy()
    del kept
    second = pipeline.step(grad)
    assert np.array_equal(np.asarray(view), first[10:])  # a view held: a new buffer
    address = np.asarray(second).ctypes.data
    del second, view
    assert np.asarray(pipeline.step(grad)).ctypes.data == address  # released: reused

