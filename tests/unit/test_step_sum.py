"""StepSum (torch/out_of_band.py): one step's summed pairs written back into each gradient, checked
bitwise against a numpy oracle that densifies the fused sum and cuts it by the layout."""
import contextlib

import numpy as np
import pytest
import torch

from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu
from horovod_sparse.torch.buckets import StepSum, probe_scale

SHAPES = {"a.weight": ((3, 4), torch.float32), "b.bias": ((5,), torch.float64),
          "c.weight": ((2, 3, 2), torch.float32), "d.bias": ((1,), torch.float32)}


def make(seed):
    rng = np.random.default_rng(seed)
    keys = sorted(SHAPES)
    grads = {k: torch.from_numpy(rng.standard_normal(SHAPES[k][0])).to(SHAPES[k][1]) for k in keys}
    layout = GradientLayout([(k, tuple(grads[k].shape), str(grads[k].dtype)[6:]) for k in keys])
    return keys, grads, layout, rng


def oracle(layout, indices, values, scale):
    dense = np.zeros(layout.n, np.float32)
    dense[indices] = values * np.float32(scale)
    return {e.key: dense[e.offset:e.offset + e.size].reshape(e.shape) for e in layout.entries}


def on(path):
    """The host's path, or the device's (where the pairs are scattered into one dense buffer first)."""
    return cpu.device_path() if path == "device" else contextlib.nullcontext()


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_sparse_sum_is_written_into_each_gradient_bitwise(scale, path):
    with on(path):
        written_bitwise(scale)


def written_bitwise(scale):
    keys, grads, layout, rng = make(1)
    assert layout.starts == [e.offset for e in layout.entries] + [layout.n]
    assert all(layout.by_key[e.key] is e for e in layout.entries)
    indices = np.sort(rng.choice(layout.n, size=9, replace=False)).astype(np.int64)
    indices[-1] = layout.n - 1  # the last gradient's only element
    values = rng.standard_normal(9).astype(np.float32)
    step = StepSum(layout, grads, (torch.from_numpy(indices), torch.from_numpy(values)))
    assert step.sparse != cpu.device_path_chosen()  # the device's path writes a dense buffer's slices
    expected = oracle(layout, indices, values, scale)
    for key in keys:
        out = step.write(key, scale)
        assert out is grads[key]  # in place, as Horovod's own allreduce
        assert out.dtype == SHAPES[key][1]
        want = expected[key].astype(out.numpy().dtype)
        assert out.numpy().tobytes() == want.tobytes(), key


@pytest.mark.parametrize("path", ["host", "device"])
def test_sparse_sum_with_no_pairs_zeroes_every_gradient(path):
    keys, grads, layout, _ = make(2)
    with on(path):
        step = StepSum(layout, grads, (torch.zeros(0, dtype=torch.int64), torch.zeros(0)))
        for key in keys:
            assert not step.write(key, 0.5).any()


def test_dense_sum_is_copied_and_scaled_bitwise():
    keys, grads, layout, rng = make(3)
    summed = rng.standard_normal(layout.n).astype(np.float32)
    step = StepSum(layout, grads, torch.from_numpy(summed))
    for e in layout.entries:
        out = step.write(e.key, 0.25)
        want = (summed[e.offset:e.offset + e.size] * np.float32(0.25)).reshape(e.shape)
        assert out.numpy().tobytes() == want.astype(out.numpy().dtype).tobytes()


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize("averaged", [True, False])
def test_a_device_scale_writes_the_host_scales_bits(size, averaged):
    """On the device path the probe's scale stays a tensor (no read-back per gradient); the
    sums written with it, sparse and dense, are those of the host's float scale."""
    probe = torch.full((1,), 1.0 if averaged else float(size))
    host = probe_scale(probe, size)
    with cpu.device_path():
        device = probe_scale(probe, size)
    assert isinstance(host, float) and isinstance(device, torch.Tensor)
    for sparse in (True, False):
        written = []
        for scale in (host, device):
            keys, grads, layout, rng = make(4)
            indices = np.sort(rng.choice(layout.n, size=9, replace=False)).astype(np.int64)
            values = rng.standard_normal(layout.n).astype(np.float32)
            summed = (torch.from_numpy(indices), torch.from_numpy(values[:9])) if sparse else torch.from_numpy(values)
            with on("device" if isinstance(scale, torch.Tensor) else "host"):
                step = StepSum(layout, grads, summed)
                written.append([step.write(key, scale).numpy().tobytes() for key in keys])
        assert written[0] == written[1], (sparse, size, averaged)
