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


def test_sync_count_counts_one_device_path_step_and_tabulates_it(monkeypatch):
    """``--sync-count`` on the CPU: the device path's step of a pipeline at P = 1, counted (the GPU
    run adds torch's own synchronisation reports, None here). gaussiank crosses once each way (its
    sample's moments are read back as two numbers); the dense sum handed over as a device buffer
    crosses nothing."""
    gradient = np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32)
    counts = bench.sync_counts("gaussiank:density=0.01", gradient, "cpu")
    assert counts["cuda_syncs"] is None and counts["ops"] > 20 and counts["syncs"] >= 1, counts
    assert counts["transfers_out"] <= 1 and counts["transfers_in"] <= 1, counts  # its sample: two numbers read
    monkeypatch.setenv("HOROVOD_SPARSE_DEVICE_BUFFERS", "on")
    handed = bench.sync_counts("dense", gradient, "cpu")
    assert (handed["transfers_out"], handed["transfers_in"], handed["handed_out"], handed["handed_in"]) == (0, 0, 1, 1)
    table = bench.sync_table({"dense": handed}).splitlines()
    assert table[0].startswith("| compressor | aten ops") and table[2].startswith("| dense | ")
    assert table[2].endswith("| - | 0 / 0 | 1 / 1 |")
