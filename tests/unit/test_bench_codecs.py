"""scripts/bench_codecs.py's pipeline path (``--device cuda`` on a GPU), run here on the CPU: one
timed call is one pipeline step whose sum lands in the gradient, as the PyTorch frontend writes it."""
import numpy as np

from scripts_under_test import load_script

bench = load_script("bench_codecs")


def test_the_dense_sum_at_one_rank_leaves_the_gradient_as_it_was():
    gradient = np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32)
    prepare, run = bench.pipeline_round_trip("dense", gradient, "cpu", same_gradient=True)
    prepare()
    run()
    assert np.array_equal(run.gradient.numpy().reshape(gradient.shape), gradient)


def test_top_k_writes_k_values_into_the_gradient_and_zeros_elsewhere():
    gradient = np.random.default_rng(1).standard_normal((50, 40)).astype(np.float32)
    prepare, run = bench.pipeline_round_trip("topk:density=0.01", gradient, "cpu", same_gradient=True)
    prepare()
    run()
    flat = run.gradient
    kept = np.flatnonzero(flat.numpy())
    largest = np.argsort(-np.abs(gradient.reshape(-1)), kind="stable")[:20]
    assert sorted(kept) == sorted(largest)          # k = 0.01 x 2000, the first step's top-k
    assert np.array_equal(flat.numpy()[kept], gradient.reshape(-1)[kept])


def test_only_out_of_band_specs_take_the_pipeline_path():
    assert bench.fused_params("topk:density=0.01") == {"dense_below": 0}
    assert bench.fused_params("fp16") == {} and bench.fused_params("horovod-fp16") == {}
