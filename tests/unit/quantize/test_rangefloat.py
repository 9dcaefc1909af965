"""RangeFloatCodec: documented error bounds, sizes, zeros, signs, special values, determinism."""
import numpy as np
import pytest

from horovod_sparse.quantize.rangefloat import SPLITS, RangeFloatCodec

WIDTHS = sorted(SPLITS)


def sample(seed, count=5000, spread=6.0):
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], count)
    return (signs * 2.0 ** rng.uniform(-spread, spread, count)).astype(np.float32)


def block_windows(codec, values):
    """Per value, the smallest representable magnitude of its block (recomputed from the
    documented rule: 2**(top - 2**e + 2), top = binade of the block's rounded max)."""
    out = np.empty(values.size)
    for start in range(0, values.size, codec.block_size):
        block = values[start:start + codec.block_size]
        out[start:start + block.size] = codec.smallest(np.abs(block).max())
    return out


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("block_size", [1, 5, 256, 10**6])
def test_error_bounds_inside_and_below_the_window(bits, block_size):
    codec = RangeFloatCodec(bits, block_size=block_size)
    x = sample(bits)
    y = codec.roundtrip(x)
    smallest = block_windows(codec, x)
    exponent_bits, mantissa_bits = SPLITS[bits]
    bound = 2.0 ** -(mantissa_bits + 1)
    assert codec.relative_error == bound
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    inside = y != 0
    # every nonzero output is in its block's window, and within the relative bound
    assert np.all(np.abs(y64[inside]) >= smallest[inside])
    assert np.all(np.abs(y64[inside] - x64[inside]) <= bound * np.abs(x64[inside]))
    assert np.all(np.sign(y64[inside]) == np.sign(x64[inside]))
    # flushed values were below the window: absolute error < smallest representable
    assert np.all(np.abs(x64[~inside]) < smallest[~inside])
    # and a value at least (1 + bound) times the smallest is never flushed
    assert not np.any(~inside & (np.abs(x64) >= smallest * (1 + bound)))
    # the window: 2**e - 1 binades below the block's top
    top = np.frexp(np.abs(codec.roundtrip(np.array([np.abs(x[:block_size]).max()], np.float32))))[1] - 1
    assert codec.smallest(np.abs(x[:block_size]).max()) == 2.0 ** (top[0] - 2 ** exponent_bits + 2)


@pytest.mark.parametrize("bits", WIDTHS)
def test_values_within_the_window_all_survive(bits):
    codec = RangeFloatCodec(bits, block_size=64)
    binades = 2 ** SPLITS[bits][0] - 1
    # magnitudes spread over the window only (max is exactly a power of two)
    rng = np.random.default_rng(1)
    x = (2.0 ** -rng.uniform(0, binades - 1, 64)).astype(np.float32)
    x[0] = 1.0
    y = codec.roundtrip(x)
    assert np.all(y != 0)
    assert np.all(np.abs(y - x) <= codec.relative_error * np.abs(x))


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 8, 255, 256, 257, 1000])
def test_nbytes_exact(bits, count):
    codec = RangeFloatCodec(bits)
    data = codec.encode(sample(count, count) if count else np.empty(0, np.float32))
    assert data.dtype == np.uint8 and data.ndim == 1
    assert data.size == codec.nbytes(count) == -(-count // 256) + -(-count * bits // 8)
    assert codec.decode(data, count).size == count
    assert codec.decode(data, count).dtype == np.float32


@pytest.mark.parametrize("bits", WIDTHS)
def test_zeros_signs_and_specials(bits):
    codec = RangeFloatCodec(bits, block_size=4)
    x = np.array([0.0, -0.0, 1.5, -1.5,             # block 1
                  0.0, 0.0, 0.0, 0.0,               # block 2: all zero
                  1e-42, -1e-40, 3.0, 0.0,          # subnormals flush to zero
                  np.inf, -np.inf, np.nan, 1.0,     # non-finite: window at the top
                  3.4028235e38, -3.4028235e38, 1.0, -2.0], np.float32)
    y = codec.roundtrip(x)
    assert np.all(y[[0, 1, 4, 5, 6, 7, 8, 9, 11]] == 0)
    assert not np.any(np.signbit(y[[0, 1, 4, 5, 6, 7]]))  # zero decodes as +0
    assert y[2] > 0 and y[3] < 0 and y[2] == -y[3]
    assert y[12] == np.inf and y[13] == -np.inf and np.isnan(y[14]) and y[15] == 0
    largest = np.float32((2 - 2.0 ** -SPLITS[bits][1]) * 2.0 ** 127)
    assert y[16] == largest and y[17] == -largest  # saturates at the largest finite code, no inf


@pytest.mark.parametrize("bits", WIDTHS)
def test_deterministic_and_pure(bits):
    codec = RangeFloatCodec(bits)
    x = sample(7)
    a, b = codec.encode(x, seed=1), codec.encode(x.copy(), seed=99)
    assert np.array_equal(a, b)
    assert np.array_equal(codec.decode(a, x.size).view(np.uint32), codec.decode(b, x.size).view(np.uint32))
    # decoding is idempotent on the code's own values
    y = codec.roundtrip(x)
    assert np.array_equal(codec.roundtrip(y).view(np.uint32), y.view(np.uint32))
    assert not codec.stochastic and codec.aggregate == "sum"


def test_float64_input_is_cast_to_float32():
    codec = RangeFloatCodec(16)
    x = sample(3).astype(np.float64)
    assert np.array_equal(codec.encode(x), codec.encode(x.astype(np.float32)))


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 5, 7, 9, 24, 32, -8, 8.0, True, "8", None])
def test_unsupported_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        RangeFloatCodec(bits)


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True, None])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        RangeFloatCodec(8, block_size=block_size)


def test_repr_identifies_the_code():
    assert repr(RangeFloatCodec(12, block_size=32)) == "RangeFloatCodec(bits=12, block_size=32)"
    assert repr(RangeFloatCodec(8)) != repr(RangeFloatCodec(16))
