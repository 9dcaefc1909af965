"""Every sparsifying compressor refuses bad parameters at construction, naming the parameter."""
import math

import pytest

import horovod_sparse
from horovod_sparse.compressors.sparsifiers import (DGCCompressor, GaussianKCompressor, GTopKCompressor,
                                                    OkTopKCompressor, ThresholdCompressor, TopKCompressor)

BAD_FRACTIONS = [0, -0.1, 1.5, math.nan, math.inf, "0.1", True, None]
WITH_DENSITY = ["topk", "oktopk", "gaussiank", "dgc", "gtopk"]
WITH_ERROR_FEEDBACK = ["topk", "oktopk", "gaussiank", "threshold", "gtopk"]


def test_all_six_are_registered_fused_and_stateful():
    classes = {"topk": TopKCompressor, "oktopk": OkTopKCompressor, "gaussiank": GaussianKCompressor,
               "threshold": ThresholdCompressor, "dgc": DGCCompressor, "gtopk": GTopKCompressor}
    assert set(classes) <= set(horovod_sparse.available())
    for name, cls in classes.items():
        compressor = horovod_sparse.create(name)
        assert type(compressor) is cls and compressor.name == name
        assert compressor.out_of_band is True and compressor.stateful is True
        assert callable(compressor.make_pipeline)
        with pytest.raises(NotImplementedError, match="out-of-band compressor"):
            compressor.compress(None, None, None)
        with pytest.raises(NotImplementedError, match="out-of-band compressor"):
            compressor.decompress(None, None, None)


def test_defaults_and_params_round_trip_through_spec():
    # the tests' conftest sets $HOROVOD_SPARSE_WARMUP_STEPS to 0 (test_the_warm_up_defaults...)
    assert TopKCompressor().params == dict(density=0.01, error_feedback=True, exchange="allgather",
                                           warmup_steps=0)
    assert OkTopKCompressor().params == dict(density=0.01, tau=64, tau_prime=32, warmup_steps=0,
                                             error_feedback=True)
    assert GaussianKCompressor().params == dict(density=0.01, error_feedback=True, exchange="allgather")
    assert ThresholdCompressor().params == dict(value=1e-3, error_feedback=True, exchange="allgather")
    assert DGCCompressor().params == dict(density=0.001, momentum=0.9, sample_fraction=0.01,
                                          exchange="allgather")
    assert GTopKCompressor().params == dict(density=0.01, error_feedback=True)
    for compressor in (TopKCompressor(0.05, exchange="dsa"), OkTopKCompressor(tau=8, warmup_steps=2),
                       ThresholdCompressor(0.5, exchange="dsa"), DGCCompressor(momentum=0.5)):
        again = horovod_sparse.create(compressor.spec)
        assert again.params == compressor.params


@pytest.mark.parametrize("name", WITH_DENSITY)
@pytest.mark.parametrize("density", BAD_FRACTIONS)
def test_density_outside_zero_one_is_refused(name, density):
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
        horovod_sparse.create(name, density=density)


@pytest.mark.parametrize("name", WITH_ERROR_FEEDBACK)
@pytest.mark.parametrize("value", [1, "yes", None])
def test_error_feedback_must_be_bool(name, value):
    with pytest.raises(ValueError, match="error_feedback must be True or False"):
        horovod_sparse.create(name, error_feedback=value)


@pytest.mark.parametrize("name, choices", [
    ("topk", r"\['allgather', 'oktopk', 'gtopk', 'dsa'\]"),
    ("gaussiank", r"\['allgather', 'dsa'\]"),
    ("threshold", r"\['allgather', 'dsa'\]"),
    ("dgc", r"\['allgather', 'dsa'\]"),
])
@pytest.mark.parametrize("exchange", ["dense", "ring", "", None, 3])
def test_exchange_must_be_one_of_the_choices(name, choices, exchange):
    with pytest.raises(ValueError, match="exchange must be one of " + choices):
        horovod_sparse.create(name, exchange=exchange)


@pytest.mark.parametrize("name, exchange", [("gaussiank", "oktopk"), ("threshold", "gtopk"),
                                            ("dgc", "oktopk")])
def test_threshold_selections_refuse_the_top_k_exchanges(name, exchange):
    with pytest.raises(ValueError, match="exchange must be one of"):
        horovod_sparse.create(name, exchange=exchange)


@pytest.mark.parametrize("name", ["oktopk", "gtopk"])
def test_oktopk_and_gtopk_have_no_exchange_choice(name):
    with pytest.raises(ValueError, match=f"{name} has no parameter 'exchange'"):
        horovod_sparse.create(name, exchange="allgather")


@pytest.mark.parametrize("param", ["tau", "tau_prime"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "8", True, None, 2**31])
def test_oktopk_periods_are_positive_ints(param, value):
    with pytest.raises(ValueError, match=rf"{param} must be an integer in \[1, 2147483647\]"):
        horovod_sparse.create("oktopk", **{param: value})


@pytest.mark.parametrize("name", ["topk", "oktopk", "powersgd"])
@pytest.mark.parametrize("value", [-1, 1.0, "0", True, 2**31])
def test_warmup_steps_is_a_nonnegative_int(name, value):
    with pytest.raises(ValueError, match=r"warmup_steps must be an integer in \[0, 2147483647\]"):
        horovod_sparse.create(name, warmup_steps=value)


@pytest.mark.parametrize("name", ["topk", "oktopk", "powersgd"])
def test_the_warm_up_defaults_to_100_steps_or_the_environments(name, monkeypatch):
    monkeypatch.delenv("HOROVOD_SPARSE_WARMUP_STEPS")
    assert horovod_sparse.create(name).warmup_steps == 100
    assert horovod_sparse.create(name, warmup_steps=7).warmup_steps == 7
    assert horovod_sparse.registry.create_steady(name).warmup_steps == 0   # auto's candidates, benchmarks
    monkeypatch.setenv("HOROVOD_SPARSE_WARMUP_STEPS", "250")
    assert horovod_sparse.create(name).warmup_steps == 250
    monkeypatch.setenv("HOROVOD_SPARSE_WARMUP_STEPS", "many")
    with pytest.raises(ValueError, match="HOROVOD_SPARSE_WARMUP_STEPS must be an integer"):
        horovod_sparse.create(name)


@pytest.mark.parametrize("value", [0, -1e-3, math.inf, math.nan, "1e-3", True, None])
def test_threshold_value_is_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=r"value must be a finite number > 0"):
        horovod_sparse.create("threshold", value=value)


@pytest.mark.parametrize("momentum", [-0.1, 1, 1.5, math.nan, "0.9", True, None])
def test_dgc_momentum_in_zero_one(momentum):
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\)"):
        horovod_sparse.create("dgc", momentum=momentum)


@pytest.mark.parametrize("fraction", BAD_FRACTIONS)
def test_dgc_sample_fraction_in_zero_one(fraction):
    with pytest.raises(ValueError, match=r"sample_fraction must be a number in \(0, 1\]"):
        horovod_sparse.create("dgc", sample_fraction=fraction)


def test_valid_edges_are_accepted():
    TopKCompressor(density=1.0)
    OkTopKCompressor(tau=1, tau_prime=1, warmup_steps=0)
    ThresholdCompressor(value=1e-30)
    DGCCompressor(momentum=0.0, sample_fraction=1.0)


@pytest.mark.parametrize("density, n, k", [(0.01, 0, 0), (0.01, 1, 1), (0.01, 100, 1),
                                           (0.01, 101, 2), (0.5, 7, 4), (1.0, 10, 10)])
def test_k_is_ceil_density_n_at_least_one(density, n, k):
    assert TopKCompressor(density).k_for(n) == k
