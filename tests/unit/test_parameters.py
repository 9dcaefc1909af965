"""Bad parameters fail at construction with a ValueError naming the parameter and its range."""
import math

import pytest

import horovod_sparse
from horovod_sparse import registry


def test_available_lists_the_compressors():
    assert {"none", "fp16", "randomk"} <= set(horovod_sparse.available())


@pytest.mark.parametrize("density", [0, -0.1, 1.5, math.nan, math.inf, "0.1", True, None])
def test_density_outside_zero_one_is_refused(density):
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
        horovod_sparse.create("randomk", density=density)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_error_feedback_must_be_bool(value):
    with pytest.raises(ValueError, match="error_feedback must be True or False"):
        horovod_sparse.create("randomk", error_feedback=value)


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "3"])
def test_seed_must_be_a_32_bit_unsigned_int(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 4294967295\]"):
        horovod_sparse.create("randomk", seed=seed)


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match=r"compression name must be one of \[.*'randomk'.*\], got 'topq'"):
        horovod_sparse.create("topq")


def test_unknown_parameter_lists_the_parameters():
    with pytest.raises(ValueError, match=r"randomk has no parameter 'densty'; its parameters are \['density'"):
        horovod_sparse.create("randomk:densty=0.1")
    with pytest.raises(ValueError, match="fp16 has no parameter 'density'"):
        horovod_sparse.create("fp16", density=0.5)


@pytest.mark.parametrize("spec", [None, 3, ["randomk"]])
def test_spec_must_be_a_string(spec):
    with pytest.raises(ValueError, match="compression spec must be a string"):
        horovod_sparse.create(spec)


def test_malformed_spec():
    with pytest.raises(ValueError, match="expected key=value, got 'density'"):
        horovod_sparse.create("randomk:density")


def test_spec_string_round_trips():
    compressor = horovod_sparse.create("randomk:density=0.05,error_feedback=false,seed=7")
    assert (compressor.density, compressor.error_feedback, compressor.seed) == (0.05, False, 7)
    assert registry.create(compressor.spec).params == compressor.params


def test_keyword_parameters_override_the_spec():
    assert horovod_sparse.create("randomk:density=0.05", density=0.5).density == 0.5


def test_k_is_at_least_one_and_at_most_n():
    compressor = horovod_sparse.create("randomk", density=0.001)
    assert [compressor.k_for(n) for n in (0, 1, 10, 999, 1001, 10**6)] == [0, 1, 1, 1, 2, 1000]
    assert horovod_sparse.create("randomk", density=1.0).k_for(7) == 7
