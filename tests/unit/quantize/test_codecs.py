"""Bit packing and the quantizers' codecs, single process, against independent oracles.

Oracles: np.packbits on an explicit bit matrix (bitpack); the codes' documented
definitions written out plainly in codec_oracles (uint64 hashing, explicit fixed-order
sums, element-by-element float32 arithmetic): the bytes and decoded floats must match
bitwise; torch's float32 -> bfloat16 cast (BF16, round to nearest even); the papers'
formulas (sign, scaled sign, 1-bit); and for the stochastic codes (QSGD, TernGrad) the
sample mean over S seeds, which must lie within 5 standard errors of x, the standard
error derived from each code's per-value variance bound. Every codec also runs on torch
tensors and must give bitwise the bytes and floats of numpy.
"""
import math

import numpy as np
import pytest

import codec_oracles as oracle
from horovod_sparse.quantize import codecs as codecs_module
from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.bitpack import pack, packed_nbytes, unpack
from horovod_sparse.quantize.codecs import (BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec,
                                            TernGradCodec)
from horovod_sparse.quantize.onebit_buckets import BucketedOneBitCodec
from horovod_sparse.registry import create

ALL_CODECS = [BF16Codec(), QSGDCodec(), QSGDCodec(levels=1, bucket_size=7),
              QSGDCodec(levels=2 ** 15 - 1, bucket_size=3), QSGDCodec(levels=5, bucket_size=1),
              TernGradCodec(), SignCodec(), ScaledSignCodec(), OneBitCodec(),
              Int4Codec(), Int4Codec(bits=3, bucket_size=7), Int4Codec(bits=2, bucket_size=1),
              Int4Codec(bits=8, bucket_size=13), BucketedOneBitCodec(), BucketedOneBitCodec(7),
              BucketedOneBitCodec(1)]
COUNTS = [0, 1, 7, 8, 9, 513, 1001]


def data(count, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(count) * 2.0 ** rng.uniform(-6, 6, count)).astype(np.float32)


def reference_pack(codes, bits):
    """The layout by definition: bit b of code i is stream bit i*bits + b, bytes LSB first."""
    matrix = (codes.astype(np.uint64)[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(matrix.astype(np.uint8).ravel(), bitorder="little")


# ----------------------------------------------------------------- bitpack
@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("count", [0, 1, 5, 8, 9, 15, 16, 17, 1003])
def test_bitpack_roundtrip_matches_reference_layout(bits, count):
    codes = np.random.default_rng(bits * 1000 + count).integers(0, 2 ** bits, count)
    packed = pack(codes, bits)
    assert packed.dtype == np.uint8
    assert packed.size == math.ceil(count * bits / 8) == packed_nbytes(count, bits)
    np.testing.assert_array_equal(packed, reference_pack(codes, bits))
    out = unpack(packed, bits, count)
    assert out.dtype == (np.uint8 if bits <= 8 else np.uint16)
    np.testing.assert_array_equal(out, codes)
    # Extremes: all zeros and all ones.
    for value in (0, 2 ** bits - 1):
        full = np.full(count, value)
        np.testing.assert_array_equal(unpack(pack(full, bits), bits, count), full)


def test_bitpack_bad_arguments():
    for bits in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="bits"):
            pack(np.zeros(3, np.uint8), bits)
    with pytest.raises(ValueError, match="bytes"):
        unpack(np.zeros(1, np.uint8), 3, 8)  # needs 3 bytes


# ----------------------------------------------------------- every codec
@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
@pytest.mark.parametrize("count", COUNTS)
def test_nbytes_exact_and_deterministic(codec, count):
    x = data(count, seed=count)
    code = codec.encode(x, seed=11)
    assert code.dtype == np.uint8 and code.ndim == 1 and code.size == codec.nbytes(count)
    np.testing.assert_array_equal(code, codec.encode(x.copy(), seed=11))
    out = codec.decode(code, count)
    assert out.dtype == np.float32 and out.shape == (count,)
    np.testing.assert_array_equal(out, codec.decode(code.copy(), count))  # pure
    np.testing.assert_array_equal(out, codec.roundtrip(x, seed=11))


def test_nbytes_formulas():
    for count in COUNTS:
        assert BF16Codec().nbytes(count) == 2 * count
        assert QSGDCodec(16, 512).nbytes(count) == 4 * math.ceil(count / 512) + math.ceil(count * 6 / 8)
        assert QSGDCodec(1, 7).nbytes(count) == 4 * math.ceil(count / 7) + math.ceil(count * 2 / 8)
        assert QSGDCodec(2 ** 15 - 1, 3).nbytes(count) == 4 * math.ceil(count / 3) + 2 * count
        assert TernGradCodec().nbytes(count) == 4 + math.ceil(count / 4)
        assert SignCodec().nbytes(count) == math.ceil(count / 8)
        assert ScaledSignCodec().nbytes(count) == 4 + math.ceil(count / 8)
        assert OneBitCodec().nbytes(count) == 8 + math.ceil(count / 8)
        assert Int4Codec().nbytes(count) == 4 * math.ceil(count / 128) + math.ceil(count / 2)
        assert Int4Codec(3, 7).nbytes(count) == 4 * math.ceil(count / 7) + math.ceil(count * 3 / 8)
        assert Int4Codec(8, 13).nbytes(count) == 4 * math.ceil(count / 13) + count
        assert BucketedOneBitCodec(7).nbytes(count) == 8 * math.ceil(count / 7) + math.ceil(count / 8)
    assert [QSGDCodec(levels).bits for levels in (1, 2, 3, 4, 15, 16, 255, 256)] == [2, 3, 3, 4, 5, 6, 9, 10]
    assert [(Int4Codec(bits).bits, Int4Codec(bits).levels) for bits in (2, 3, 4, 5, 8)] == \
        [(2, 1), (3, 3), (4, 7), (5, 15), (8, 127)]


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_stochastic_codes_depend_on_seed_only(codec):
    x = data(2000, seed=3)
    a, b = codec.encode(x, seed=1), codec.encode(x, seed=2)
    # QSGD with one value per bucket is exact (|x| / norm = 1), hence seed-free.
    random = codec.stochastic and getattr(codec, "bucket_size", 2) > 1
    assert (not np.array_equal(a, b)) == random


@pytest.mark.parametrize("codec", ALL_CODECS, ids=repr)
def test_non_finite_input_does_not_raise(codec):
    x = np.array([1, np.nan, np.inf, -np.inf, 0, -0.0, -2, 3e38, -3e38], np.float32)
    out = codec.roundtrip(x, seed=4)
    assert out.shape == x.shape and out.dtype == np.float32
    finite_in = codec.roundtrip(np.array([1, 0, -2], np.float32), seed=4)
    assert np.all(np.isfinite(finite_in))


# --------------------------------------------------------------------- bf16
def test_bf16_matches_torch_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, 100000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2 ** 16, 1000, dtype=np.uint32) << np.uint32(16)) | np.uint32(0x8000)
    x = np.concatenate([bits, ties]).view(np.float32)
    x = np.concatenate([x, np.array([0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40], np.float32)])
    x = x[~np.isnan(x)]
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(BF16Codec().roundtrip(x).view(np.uint32), expected.view(np.uint32))


def test_bf16_relative_error_and_nan():
    x = data(10000, seed=5)
    out = BF16Codec().roundtrip(x)
    assert np.all(np.abs(out.astype(np.float64) - x) <= 2.0 ** -8 * np.abs(x.astype(np.float64)))
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF80FFFF, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert np.all(np.isnan(BF16Codec().roundtrip(nans)))


# --------------------------------------------------------------------- qsgd
def qsgd_norms(x, bucket):
    x64 = x.astype(np.float64)
    return np.array([np.sqrt(np.sum(x64[i:i + bucket] ** 2)) for i in range(0, x.size, bucket)],
                    dtype=np.float32)


@pytest.mark.parametrize("levels,bucket", [(16, 512), (1, 7), (3, 1), (255, 100)])
def test_qsgd_structure_and_error_bound(levels, bucket):
    x = data(1001, seed=levels)
    codec = QSGDCodec(levels, bucket)
    code = codec.encode(x, seed=9)
    norms = qsgd_norms(x, bucket)
    # the float32 tree sum of squares is the exact sum up to a few roundings
    np.testing.assert_allclose(code[:4 * norms.size].view(np.float32), norms, rtol=1e-5)
    norms = code[:4 * norms.size].view(np.float32)
    out = codec.decode(code, x.size).astype(np.float64)
    norm_each = np.repeat(norms.astype(np.float64), bucket)[:x.size]
    # decode = sign(x) * norm * l / s with an integer level l in [0, s] ...
    level = np.abs(out) / norm_each * levels
    np.testing.assert_allclose(level, np.round(level), atol=1e-3)
    assert np.all(np.round(level) <= levels)
    assert np.all((out == 0) | (np.sign(out) == np.sign(x)))
    # ... one of the two levels around |x|: error < norm / s (plus float32 rounding).
    assert np.all(np.abs(out - x) <= norm_each / levels * (1 + 1e-6))


def test_qsgd_norm_of_a_bucket_longer_than_a_block_covers_the_whole_bucket():
    """A bucket of more values than one encoding block (codecs.BLOCK) is summed block by block;
    its norm is every block's squares, not the last block's (a bug until 2026-11-25)."""
    count = codecs_module.BLOCK + 37_000
    x = data(count, seed=4)
    for like in (x, __import__("torch").from_numpy(x)):
        code = np.asarray(QSGDCodec(16, 2 ** 20).encode(like, seed=1))
        norm = code[:4].view(np.float32)[0]
        np.testing.assert_allclose(norm, np.sqrt(np.sum(x.astype(np.float64) ** 2)), rtol=1e-5)


@pytest.mark.parametrize("levels,bucket", [(4, 16), (1, 5)])
def test_qsgd_unbiased(levels, bucket):
    x = data(200, seed=1)
    codec = QSGDCodec(levels, bucket)
    samples = 3000
    mean = np.mean([codec.roundtrip(x, seed=s) for s in range(samples)], axis=0, dtype=np.float64)
    norm_each = np.repeat(qsgd_norms(x, bucket).astype(np.float64), bucket)[:x.size]
    # Per value, decode takes two neighbouring levels norm/s apart: Var <= (norm/s)**2 / 4.
    sigma = np.sqrt((norm_each / levels) ** 2 / 4 / samples)
    assert np.all(np.abs(mean - x) <= 5 * sigma + 1e-6 * np.abs(x))


def test_qsgd_zero_bucket_and_single_value_buckets():
    x = np.array([0, 0, 0, 3, -2, 0], np.float32)
    out = QSGDCodec(levels=7, bucket_size=3).roundtrip(x, seed=1)
    np.testing.assert_array_equal(out[:3], 0)
    # bucket_size 1: norm = |x|, so r = s exactly and the code is exact.
    np.testing.assert_array_equal(QSGDCodec(levels=3, bucket_size=1).roundtrip(x, seed=1), x)


# ----------------------------------------------------------------- terngrad
def test_terngrad_structure():
    x = data(1001, seed=2)
    code = TernGradCodec().encode(x, seed=3)
    scale = np.float32(np.max(np.abs(x)))
    assert code[:4].view(np.float32)[0] == scale
    out = TernGradCodec().decode(code, x.size)
    assert set(np.unique(out).tolist()) <= {-scale, 0.0, scale}
    assert np.all((out == 0) | (np.sign(out) == np.sign(x)))
    assert out[np.argmax(np.abs(x))] == x[np.argmax(np.abs(x))]  # P = 1 at the maximum


def test_terngrad_unbiased():
    x = data(200, seed=4)
    samples = 3000
    mean = np.mean([TernGradCodec().roundtrip(x, seed=s) for s in range(samples)], axis=0, dtype=np.float64)
    scale = float(np.max(np.abs(x)))
    absx = np.abs(x.astype(np.float64))
    sigma = np.sqrt(absx * (scale - absx) / samples)  # Var of s*t is |x| (s - |x|) <= s**2/4
    assert np.all(np.abs(mean - x) <= 5 * sigma + 1e-6 * absx)


def test_terngrad_zero_vector():
    np.testing.assert_array_equal(TernGradCodec().roundtrip(np.zeros(9, np.float32), seed=1), 0)


# ------------------------------------------------------------- sign codes
def test_sign_exact():
    x = np.concatenate([data(1001, seed=6), np.array([0, -0.0], np.float32)])
    np.testing.assert_array_equal(SignCodec().roundtrip(x), np.where(x < 0, -1, 1).astype(np.float32))
    assert SignCodec.aggregate == "majority"


def test_scaled_sign_exact():
    x = data(1001, seed=7)
    scale = np.float32(np.mean(np.abs(x.astype(np.float64))))
    out = ScaledSignCodec().roundtrip(x)
    stored = ScaledSignCodec().encode(x)[:4].view(np.float32)[0]
    assert abs(stored - scale) <= 1e-5 * scale  # a float32 tree sum, a few roundings from exact
    np.testing.assert_array_equal(out, np.where(x < 0, -stored, stored))
    assert ScaledSignCodec().encode(np.zeros(0, np.float32)).view(np.float32)[0] == 0


def test_onebit_exact():
    x = data(1001, seed=8)
    neg = np.float32(np.mean(x[x < 0].astype(np.float64)))
    pos = np.float32(np.mean(x[x >= 0].astype(np.float64)))
    stored_pos, stored_neg = OneBitCodec().encode(x)[:8].view(np.float32)
    np.testing.assert_allclose([stored_pos, stored_neg], [pos, neg], rtol=1e-5)
    np.testing.assert_array_equal(OneBitCodec().roundtrip(x), np.where(x < 0, stored_neg, stored_pos))
    # One side empty: its reconstruction value is 0 (unused).
    only_pos = np.array([1, 2, 0], np.float32)
    np.testing.assert_array_equal(OneBitCodec().roundtrip(only_pos), np.float32(1.0))
    np.testing.assert_array_equal(OneBitCodec().encode(only_pos)[:8].view(np.float32), [1, 0])


def assert_tensorflow_gives(codec, x, expected_bytes, expected_values):
    """TensorFlow's ops (the frontend's on-device step) encode ``x`` to the oracle's bytes and
    floats, and decode the oracle's bytes to its floats, bit for bit."""
    tf = pytest.importorskip("tensorflow")
    code, values = codec.encode_decoded(tf.constant(x))
    np.testing.assert_array_equal(code.numpy(), expected_bytes)
    np.testing.assert_array_equal(values.numpy().view(np.uint32), expected_values.view(np.uint32))
    decoded = codec.decode(tf.constant(expected_bytes), x.size).numpy()
    np.testing.assert_array_equal(decoded.view(np.uint32), expected_values.view(np.uint32))


def onebit_adversarial(bucket, seed=0):
    """Buckets that stress the two means, ``bucket`` values each (the last one short): all
    zeros of both signs, all negative, all positive, a NaN, infs of both signs together,
    denormals, huge values whose sum overflows, random normals; shuffled within each bucket."""
    rng = np.random.default_rng(seed)
    pieces = [np.where(rng.random(bucket) < 0.5, -0.0, 0.0), -np.abs(rng.standard_normal(bucket)) - 1e-3,
              np.abs(rng.standard_normal(bucket)), np.concatenate([[np.nan], rng.standard_normal(bucket - 1)]),
              np.concatenate([[np.inf, -np.inf], rng.standard_normal(bucket)])[:max(bucket, 2)],
              rng.standard_normal(bucket) * 1e-41, np.full(bucket, 3e38), rng.standard_normal(bucket // 2 + 1)]
    for piece in pieces:
        rng.shuffle(piece)
    return np.concatenate(pieces).astype(np.float32)


@pytest.mark.parametrize("bucket", [1, 8, 13, 256])
def test_onebit_buckets_adversarial_inputs_match_the_oracle(bucket):
    """Bytes and floats bitwise the oracle's on numpy, on torch's own kernels (what a CUDA
    tensor runs, ``cpu.device_path()``) and on TensorFlow's ops, encode's ``decoded`` too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    from horovod_sparse.ops import cpu
    x = onebit_adversarial(bucket, seed=bucket)
    codec = BucketedOneBitCodec(bucket)
    expected_bytes, expected_values = oracle.onebit_buckets(x, bucket)
    decoded = np.empty(x.size, np.float32)
    np.testing.assert_array_equal(codec.encode(x, decoded=decoded), expected_bytes)
    np.testing.assert_array_equal(decoded.view(np.uint32), expected_values.view(np.uint32))
    with cpu.device_path(), np.errstate(all="ignore"):
        t_decoded = torch.empty(x.size)
        code = codec.encode(torch.from_numpy(x.copy()), decoded=t_decoded)
        values = codec.decode(code, x.size)
    np.testing.assert_array_equal(code.numpy(), expected_bytes)
    for got in (values, t_decoded):
        np.testing.assert_array_equal(got.numpy().view(np.uint32), expected_values.view(np.uint32))
    assert_tensorflow_gives(codec, x, expected_bytes, expected_values)


def test_onebit_buckets_fit_each_buckets_scale():
    """Two buckets of very different scales: each decodes to its own means (the paper's code,
    one pair for the vector, gives the small bucket the large one's), and its error is the
    smaller by orders of magnitude."""
    x = np.concatenate([data(256, seed=1) * 1e-4, data(256, seed=2)]).astype(np.float32)
    small = x[:256]
    bucketed = BucketedOneBitCodec(256).roundtrip(x)[:256]
    whole = OneBitCodec().roundtrip(x)[:256]
    assert np.abs(bucketed).max() < 1e-3 < np.abs(whole).min()
    assert np.linalg.norm(bucketed - small) < 1e-3 * np.linalg.norm(whole - small)


# ----------------------------------------------------------- bad parameters
@pytest.mark.parametrize("kwargs,name", [(dict(levels=0), "levels"), (dict(levels=2 ** 15), "levels"),
                                         (dict(levels=2.5), "levels"), (dict(bucket_size=0), "bucket_size"),
                                         (dict(bucket_size=True), "bucket_size")])
def test_qsgd_codec_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        QSGDCodec(**kwargs)


@pytest.mark.parametrize("kwargs,accepted", [(dict(bits=1), r"bits must be an integer in \[2, 8\]"),
                                             (dict(bits=9), r"bits must be an integer in \[2, 8\]"),
                                             (dict(bits=4.0), r"bits must be an integer in \[2, 8\]"),
                                             (dict(bits=True), r"bits must be an integer in \[2, 8\]"),
                                             (dict(bucket_size=0), r"bucket_size must be an integer in \[1, "),
                                             (dict(bucket_size=2 ** 31), r"bucket_size must be an integer in \[1, ")])
def test_int4_bad_parameters(kwargs, accepted):
    """The codec and the compressor refuse alike, naming the parameter and its range."""
    with pytest.raises(ValueError, match=accepted):
        Int4Codec(**kwargs)
    with pytest.raises(ValueError, match=accepted):
        create("int4", **kwargs)


@pytest.mark.parametrize("spec,params,name", [
    ("qsgd", dict(levels=0), "levels"), ("qsgd", dict(levels=40000), "levels"),
    ("qsgd", dict(bucket_size=0), "bucket_size"), ("qsgd", dict(method="ring"), "method"),
    ("bf16", dict(method="allreduce"), "method"), ("terngrad", dict(method=3), "method"),
    ("signsgd", dict(method="x"), "method"), ("efsignsgd", dict(method="x"), "method"),
    ("onebit", dict(method="x"), "method"), ("signum", dict(momentum=1.0), "momentum"),
    ("signum", dict(momentum=-0.1), "momentum"), ("signum", dict(method="x"), "method"),
    ("onebit", dict(error_feedback=1), "error_feedback"), ("signsgd", dict(error_feedback=True),
                                                           "error_feedback"),
    ("int4", dict(method="ring"), "method"), ("int4", dict(error_feedback="yes"), "error_feedback"),
    ("onebit", dict(bucket_size=0), r"bucket_size must be an integer in \[1, 2147483647\]"),
    ("onebit", dict(bucket_size=2.5), "bucket_size")])
def test_compressor_bad_parameters(spec, params, name):
    with pytest.raises(ValueError, match=name):
        create(spec, **params)


def test_compressor_specs_and_defaults():
    assert create("qsgd").params == dict(levels=16, bucket_size=512, method="alltoall", error_feedback=False)
    assert create("qsgd:levels=4,method=allgather").spec == \
        "qsgd:levels=4,bucket_size=512,method=allgather,error_feedback=False"
    assert create("signum").params == dict(momentum=0.9, method="alltoall")
    assert create("int4").params == dict(bits=4, bucket_size=128, method="alltoall", error_feedback=True)
    assert create("int4:bits=3,bucket_size=64").codec().__repr__() == "Int4Codec(bits=3, bucket_size=64)"
    assert create("efsignsgd").error_feedback and create("onebit").error_feedback
    assert create("onebit").params == dict(method="alltoall", error_feedback=True)
    assert repr(create("onebit").codec()) == "OneBitCodec()"
    assert create("onebit:bucket_size=256").spec == "onebit:bucket_size=256,method=alltoall,error_feedback=True"
    assert repr(create("onebit:bucket_size=256").codec()) == "BucketedOneBitCodec(bucket_size=256)"
    assert not create("bf16").error_feedback and not create("terngrad").error_feedback
    for name in ("bf16", "qsgd", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit"):
        assert create(name).out_of_band


# ------------------------------------------- the documented definitions, bitwise
ORACLES = {
    "QSGDCodec(levels=16, bucket_size=512)": lambda x, seed: oracle.qsgd(x, 16, 512, seed),
    "QSGDCodec(levels=1, bucket_size=7)": lambda x, seed: oracle.qsgd(x, 1, 7, seed),
    "QSGDCodec(levels=32767, bucket_size=3)": lambda x, seed: oracle.qsgd(x, 2 ** 15 - 1, 3, seed),
    "QSGDCodec(levels=5, bucket_size=1)": lambda x, seed: oracle.qsgd(x, 5, 1, seed),
    "QSGDCodec(levels=100, bucket_size=10)": lambda x, seed: oracle.qsgd(x, 100, 10, seed),
    "TernGradCodec()": lambda x, seed: oracle.terngrad(x, seed),
    "SignCodec()": lambda x, seed: oracle.sign(x),
    "ScaledSignCodec()": lambda x, seed: oracle.scaled_sign(x),
    "OneBitCodec()": lambda x, seed: oracle.onebit(x),
    "Int4Codec(bits=4, bucket_size=128)": lambda x, seed: oracle.int4(x, 4, 128),
    "Int4Codec(bits=3, bucket_size=7)": lambda x, seed: oracle.int4(x, 3, 7),
    "Int4Codec(bits=2, bucket_size=1)": lambda x, seed: oracle.int4(x, 2, 1),
    "Int4Codec(bits=8, bucket_size=13)": lambda x, seed: oracle.int4(x, 8, 13),
    "BucketedOneBitCodec(bucket_size=256)": lambda x, seed: oracle.onebit_buckets(x, 256),
    "BucketedOneBitCodec(bucket_size=7)": lambda x, seed: oracle.onebit_buckets(x, 7),
    "BucketedOneBitCodec(bucket_size=1)": lambda x, seed: oracle.onebit_buckets(x, 1),
}
ORACLE_CODECS = [c for c in ALL_CODECS if repr(c) in ORACLES] + [QSGDCodec(levels=100, bucket_size=10)]


@pytest.mark.parametrize("codec", ORACLE_CODECS, ids=repr)
@pytest.mark.parametrize("count", [0, 1, 9, 1001])
def test_codes_match_the_documented_definition(codec, count):
    x = data(count, seed=count + 7)
    x[::17] = 0
    expected_bytes, expected_values = ORACLES[repr(codec)](x, 12345)
    code = codec.encode(x, seed=12345)
    np.testing.assert_array_equal(code, expected_bytes)
    np.testing.assert_array_equal(codec.decode(code, count).view(np.uint32), expected_values.view(np.uint32))



@pytest.mark.parametrize("codec", ORACLE_CODECS, ids=repr)
def test_broken_buckets_on_the_device_path_match_the_definition(codec):
    """What a CUDA tensor runs, on the CPU (``cpu.device_path()``): buckets broken by a NaN, an
    inf, a huge value or all zeros take level 0 by masked fills, with no read-back of whether
    any is broken; the bytes and floats are the definition's, bit for bit."""
    torch = pytest.importorskip("torch")
    from horovod_sparse.ops import cpu
    x = data(1001, seed=3)
    x[5], x[40], x[100:140], x[300], x[1000] = np.nan, -np.inf, 0, 3e38, np.inf
    expected_bytes, expected_values = ORACLES[repr(codec)](x, 12345)
    with cpu.device_path(), np.errstate(all="ignore"):
        code = codec.encode(torch.from_numpy(x.copy()), seed=12345)
        values = codec.decode(code, x.size)
    np.testing.assert_array_equal(code.numpy(), expected_bytes)
    np.testing.assert_array_equal(values.numpy().view(np.uint32), expected_values.view(np.uint32))


def test_bf16_nans_on_the_device_path_are_numpys_quiet_nans():
    """bf16's NaNs (a signalling one too) become the quiet NaN by a masked fill on the device
    path, where numpy's path checks a sum first: the same bytes."""
    torch = pytest.importorskip("torch")
    from horovod_sparse.ops import cpu
    x = data(1001, seed=4)
    x[7], x[70], x[700] = np.nan, np.inf, -np.inf
    x[9:10].view(np.uint32)[0] = 0x7F800001  # a signalling NaN: its top 16 bits would read as inf
    expected = BF16Codec().encode(x)
    with cpu.device_path():
        code = BF16Codec().encode(torch.from_numpy(x.copy()))
    np.testing.assert_array_equal(code.numpy(), expected)


# -------------------------------------------------------------------- int4
def int4_adversarial(bucket, seed=0):
    """Buckets that stress the absmax code, each ``bucket`` values (the last one short): level
    ties x * L / S = k + 1/2 (bucket max 7 or 14, so L / S is exact at 4 bits), zeros of both
    signs, all-zero buckets, denormals alone and beside a normal max, huge (3e38) and tiny
    (1e-30) magnitudes, maxima about L * 2**-126 (the smallest scale), a NaN, an inf, a max on its own, random normals; shuffled within each
    bucket."""
    rng = np.random.default_rng(seed)
    ties = np.float32([-6.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 5.5, 6.5])
    pieces = [np.concatenate([[7], rng.choice(ties, bucket - 1)]),
              np.concatenate([[-14], 2 * rng.choice(ties, bucket - 1)]),
              np.where(rng.random(bucket) < 0.5, -0.0, 0.0), np.zeros(bucket),
              rng.standard_normal(bucket) * 1e-41, np.concatenate([[1.0], rng.standard_normal(bucket - 1) * 1e-41]),
              rng.uniform(-3e38, 3e38, bucket), rng.standard_normal(bucket) * 1e-30,
              rng.uniform(-8e-38, 8e-38, bucket),
              np.concatenate([[np.nan], rng.standard_normal(bucket - 1)]),
              np.concatenate([[-np.inf], rng.standard_normal(bucket - 1)]),
              np.concatenate([[-5.0], np.zeros(bucket - 1)]), rng.standard_normal(bucket // 2 + 1)]
    for piece in pieces:
        rng.shuffle(piece)
    return np.concatenate(pieces).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("bucket", [1, 8, 13, 128])
def test_int4_adversarial_inputs_match_the_oracle(bits, bucket):
    """Bytes and floats bitwise the oracle's, on numpy arrays and torch tensors (an odd total
    length: the last bucket short)."""
    torch = pytest.importorskip("torch")
    x = int4_adversarial(bucket, seed=bits * 100 + bucket)
    codec = Int4Codec(bits, bucket)
    expected_bytes, expected_values = oracle.int4(x, bits, bucket)
    for like, as_numpy in ((x, np.asarray), (torch.from_numpy(x.copy()), lambda t: t.numpy())):
        code = codec.encode(like)
        np.testing.assert_array_equal(as_numpy(code), expected_bytes)
        values = as_numpy(codec.decode(code, x.size))
        np.testing.assert_array_equal(values.view(np.uint32), expected_values.view(np.uint32))


@pytest.mark.parametrize("bits,bucket", [(2, 8), (3, 13), (4, 128), (8, 128), (3, 2 ** 31 - 1)])
def test_int4_on_torchs_own_kernels_is_the_oracles(bits, bucket, monkeypatch):
    """What a CUDA tensor runs (torch's amax, round, divide; a CPU tensor's math runs on its numpy
    view), here on the CPU: the oracle's bytes and floats, and encode's ``decoded``."""
    torch = pytest.importorskip("torch")
    from horovod_sparse.quantize import codec as codec_module
    monkeypatch.setattr(codec_module, "_kernel", lambda x: x)
    x = int4_adversarial(min(bucket, 128), seed=bits)
    codec = Int4Codec(bits, bucket)
    expected_bytes, expected_values = oracle.int4(x, bits, bucket)
    decoded = torch.empty(x.size)
    code = codec.encode(torch.from_numpy(x.copy()), decoded=decoded)
    np.testing.assert_array_equal(code.numpy(), expected_bytes)
    np.testing.assert_array_equal(decoded.numpy().view(np.uint32), expected_values.view(np.uint32))
    values = codec.decode(code, x.size).numpy()
    np.testing.assert_array_equal(values.view(np.uint32), expected_values.view(np.uint32))


@pytest.mark.parametrize("bits,bucket", [(2, 8), (3, 13), (4, 128), (8, 128), (3, 2 ** 31 - 1)])
def test_int4_on_tensorflow_is_the_oracles(bits, bucket):
    """TensorFlow's ops (the frontend's on-device step) give the oracle's bytes and floats, also
    where TensorFlow flushes denormals on the CPU (the smallest scales, huge maxima)."""
    pytest.importorskip("tensorflow")
    x = int4_adversarial(min(bucket, 128), seed=bits)
    codec = Int4Codec(bits, bucket)
    expected_bytes, expected_values = oracle.int4(x, bits, bucket)
    assert_tensorflow_gives(codec, x, expected_bytes, expected_values)


def test_int4_ties_round_to_even_and_zero_buckets_decode_as_zero():
    x = np.float32([7, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, 0, -0.0, 0, 0, 1e-41, -1e-40, 0, 0])
    codec = Int4Codec(bits=4, bucket_size=8)
    out = codec.roundtrip(x)  # S = 7: one level per unit, exact
    np.testing.assert_array_equal(out[:8], [7, 0, 2, 2, 0, -2, -2, 6])
    np.testing.assert_array_equal(out[8:], 0)  # all zero but denormals, below L * 2**-126
    np.testing.assert_array_equal(codec.encode(x)[:8].view(np.float32), [7, 0])  # scale 0, not 1e-40
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_int4_error_is_at_most_half_a_level(bits):
    x = data(1001, seed=bits)
    codec = Int4Codec(bits, 64)
    levels = 2 ** (bits - 1) - 1
    code = codec.encode(x)
    scales = code[:4 * 16].view(np.float32)
    np.testing.assert_array_equal(scales, [np.max(np.abs(x[i:i + 64])) for i in range(0, 1001, 64)])
    scale_each = np.repeat(scales.astype(np.float64), 64)[:x.size]
    out = codec.decode(code, x.size).astype(np.float64)
    assert np.all(np.abs(out - x) <= scale_each / levels / 2 * (1 + 1e-5))
    assert np.all((out == 0) | (np.sign(out) == np.sign(x)))


def test_random_stream_matches_the_documented_hash():
    from horovod_sparse.quantize.scratch import Scratch
    from horovod_sparse.quantize.uniform import random_int16
    for seed in (0, 1, 2 ** 63 - 1, 987654321):
        expected = oracle.random_halves(1001, seed)
        np.testing.assert_array_equal(random_int16(1001, seed, Scratch(), np.zeros(1, np.float32)), expected)
        np.testing.assert_array_equal(random_int16(500, seed, Scratch(), np.zeros(1, np.float32), start=400),
                                      expected[400:900])
    u = (oracle.random_halves(200000, 5) + 32768.5) / 65536
    assert abs(u.mean() - 0.5) < 0.003 and abs(np.mean(u < 0.25) - 0.25) < 0.003


def test_bf16_nan_is_canonical():
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF80FFFF, 0x7FFFFFFF, 0xFFC00000], np.uint32).view(np.float32)
    code = BF16Codec().encode(np.concatenate([nans, np.float32([1.0])]))
    np.testing.assert_array_equal(code.view(np.uint16), [0x7FC0] * 5 + [0x3F80])


# ------------------------------------------------------ torch agrees with numpy
torch = pytest.importorskip("torch")


def torch_codecs():
    return ALL_CODECS + [QSGDCodec(levels=100, bucket_size=10), QSGDCodec(levels=200, bucket_size=64)]


@pytest.mark.parametrize("codec", torch_codecs(), ids=repr)
@pytest.mark.parametrize("count", [0, 1, 7, 9, 513, 4099])
def test_torch_codes_are_numpy_codes(codec, count):
    """Bytes, decoded floats and the ``decoded`` of encode: bitwise equal on numpy and torch,
    also into an ``out`` at an odd offset of a larger buffer."""
    x = data(count, seed=count + 3)
    x[::13] = 0
    x[1::29] = -0.0
    code = codec.encode(x, seed=77)
    decoded = np.empty(count, np.float32)
    codec.encode(x, seed=77, decoded=decoded)
    values = codec.decode(code, count)
    np.testing.assert_array_equal(decoded.view(np.uint32), values.view(np.uint32))
    fresh = type(codec).__new__(type(codec))
    fresh.__dict__.update(codec.__getstate__())   # its own scratch, on torch
    tx = torch.from_numpy(x.copy())
    holder = torch.zeros(codec.nbytes(count) + 3, dtype=torch.uint8)
    t_decoded = torch.empty(count)
    t_code = fresh.encode(tx, seed=77, out=holder[1:1 + codec.nbytes(count)], decoded=t_decoded)
    assert isinstance(t_code, torch.Tensor) and t_code.dtype == torch.uint8
    np.testing.assert_array_equal(t_code.numpy(), code)
    t_values = fresh.decode(holder[1:1 + codec.nbytes(count)], count)
    assert isinstance(t_values, torch.Tensor) and t_values.dtype == torch.float32
    np.testing.assert_array_equal(t_values.numpy().view(np.uint32), values.view(np.uint32))
    np.testing.assert_array_equal(t_decoded.numpy().view(np.uint32), values.view(np.uint32))


@pytest.mark.parametrize("codec", [QSGDCodec(), QSGDCodec(levels=3, bucket_size=7), TernGradCodec(),
                                   Int4Codec(bits=3, bucket_size=7), Int4Codec(bucket_size=1000),
                                   Int4Codec(bits=2, bucket_size=2 ** 31 - 1)], ids=repr)
def test_blocks_do_not_change_the_code(codec, monkeypatch):
    """Encoding block by block (the cache-sized loop) is the same code as in one piece."""
    x = data(5000, seed=9)
    whole = codec.encode(x, seed=3)
    monkeypatch.setattr(codecs_module, "BLOCK", 64)
    small = type(codec).__new__(type(codec))
    small.__dict__.update(codec.__getstate__())
    np.testing.assert_array_equal(small.encode(x, seed=3), whole)
    np.testing.assert_array_equal(small.encode(torch.from_numpy(x), seed=3).numpy(), whole)
    np.testing.assert_array_equal(small.decode(whole, x.size), codec.decode(whole, x.size))


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("count", [0, 5, 8, 1003])
def test_bitpack_on_torch_is_the_numpy_stream(bits, count):
    from horovod_sparse.quantize.bitpack import code_dtype, pack_into, padded_count, unpack_into
    from horovod_sparse.quantize.scratch import Scratch
    codes = np.random.default_rng(bits + count).integers(0, 2 ** bits, count)
    buffer = torch.zeros(padded_count(count), dtype=getattr(torch, code_dtype(bits)))
    buffer[:count] = torch.from_numpy(codes).to(buffer.dtype)
    out = torch.empty(packed_nbytes(count, bits), dtype=torch.uint8)
    stream = pack_into(buffer, bits, count, out, Scratch())
    np.testing.assert_array_equal(stream.numpy(), pack(codes, bits))
    back = torch.empty(padded_count(count), dtype=getattr(torch, code_dtype(bits)))
    unpacked = unpack_into(stream, bits, count, back, Scratch()).numpy().astype(np.int64) & (2 ** bits - 1)
    np.testing.assert_array_equal(unpacked, codes)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("count", [0, 3, 8, 1001])
def test_small_code_lookup_is_the_documented_stream(bits, count):
    """decode_small_codes reads code i at stream bits [i*bits, (i+1)*bits), LSB first, the same
    floats with numpy's take and torch's index_select, on numpy arrays and on tensors."""
    from horovod_sparse.quantize.lookup import decode_small_codes
    codes = np.random.default_rng(count + bits).integers(0, 2 ** bits, count)
    stream = pack(codes, bits)
    values = np.float32([1.5, -0.0, np.nan, -np.inf])[:2 ** bits]
    expected = values[codes].view(np.uint32)
    for use_torch in (False, True):
        out = np.empty(count, np.float32)
        decode_small_codes(stream, bits, count, values, out, use_torch=use_torch)
        np.testing.assert_array_equal(out.view(np.uint32), expected)
    out = torch.empty(count)
    decode_small_codes(torch.from_numpy(stream), bits, count, torch.from_numpy(values), out)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), expected)


def test_sign_vote_of_two_is_the_code_of_the_vote():
    """SignCodec.vote_of_two: the code whose decode is sign(a + b) (sign(0) = +1) for signs a, b."""
    a, b = data(1001, seed=1), data(1001, seed=2)
    a[::7], b[::11] = 0, -0.0
    codec = SignCodec()
    code_a, code_b = codec.encode(a), codec.encode(b)
    voted = codec.vote_of_two(code_a, code_b, out=np.empty_like(code_a))
    signs = codec.decode(code_a, a.size) + codec.decode(code_b, b.size)
    np.testing.assert_array_equal(codec.decode(voted, a.size), np.where(signs >= 0, 1, -1))


def test_random_stream_on_torch_is_the_numpy_stream():
    """The torch path of random_int16 (what a GPU runs; CPU codes compute on numpy views)."""
    from horovod_sparse.quantize.scratch import Scratch
    from horovod_sparse.quantize.uniform import random_int16
    for seed, count, start in ((0, 1001, 0), (2 ** 63 - 1, 500, 400), (987654321, 7, 2)):
        expected = oracle.random_halves(start + count, seed)[start:]
        got = random_int16(count, seed, Scratch(), torch.zeros(1), start=start)
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), expected)
