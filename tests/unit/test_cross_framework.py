"""The same input, seed and step give identical kept indices and values in numpy, torch and TF."""
import numpy as np
import pytest
import tensorflow as tf
import torch
from horovod.tensorflow.compression import Compressor as HorovodTFCompressor
from horovod.torch.compression import Compressor as HorovodTorchCompressor

import horovod_sparse.tensorflow as hvd_tf
import horovod_sparse.torch as hvd_torch
from horovod_sparse.reference import ReferenceCompressor

SPECS = ["none", "fp16", "randomk:density=0.1", "randomk:density=0.3,error_feedback=false,seed=5"]


def test_frontends_are_real_horovod_compressors():
    assert isinstance(hvd_torch.Compression.randomk(density=0.1), HorovodTorchCompressor)
    assert isinstance(hvd_tf.Compression.randomk(density=0.1), HorovodTFCompressor)
    assert set(hvd_torch.Compression.available()) == set(hvd_tf.Compression.available())


@pytest.mark.parametrize("spec", SPECS)
def test_numpy_torch_tensorflow_agree_bitwise(spec):
    ref = ReferenceCompressor.from_spec(spec)
    tc = hvd_torch.Compression.from_spec(spec)
    tfc = hvd_tf.Compression.from_spec(spec)
    rng = np.random.default_rng(0)
    shapes = [(40, 7), (13,)]
    for step in range(5):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        torch_out = [tc.compress(torch.from_numpy(g)) for g in grads]
        for key, (grad, (torch_payload, torch_ctx)) in enumerate(zip(grads, torch_out)):
            ref_payload, ref_ctx = ref.compress(grad, key)
            tf_payload, tf_ctx = tfc.compress(tf.constant(grad), name=key)
            np.testing.assert_array_equal(torch_payload.numpy(), ref_payload)
            np.testing.assert_array_equal(tf_payload.numpy(), ref_payload)
            if ref_ctx is not None and isinstance(ref_ctx, tuple):
                np.testing.assert_array_equal(torch_ctx[0].numpy(), ref_ctx[0])
                np.testing.assert_array_equal(tf_ctx[0].numpy(), ref_ctx[0])
            dense = ref.decompress(ref_payload, ref_ctx)
            np.testing.assert_array_equal(tc.decompress(torch_payload, torch_ctx).numpy(), dense)
            np.testing.assert_array_equal(tfc.decompress(tf_payload, tf_ctx).numpy(), dense)
    for key, entry in ref.state_dict().items():
        np.testing.assert_array_equal(tc.state_dict()[key]["residual"], entry["residual"])
        np.testing.assert_array_equal(tfc.state_dict()[key]["residual"], entry["residual"])


def test_tensorflow_eager_stateful_needs_a_name():
    with pytest.raises(ValueError, match="called eagerly without a name"):
        hvd_tf.Compression.randomk(density=0.5).compress(tf.ones([4]))


def test_reordered_gradients_are_caught_not_mixed():
    compressor = ReferenceCompressor.from_spec("randomk:density=0.5")
    compressor.compress(np.ones(4, np.float32), 0)
    with pytest.raises(ValueError, match="order of gradients changed"):
        compressor.compress(np.ones(5, np.float32), 0)


def test_state_dict_round_trip_continues_identically():
    a = ReferenceCompressor.from_spec("randomk:density=0.2")
    grads = [np.random.default_rng(i).standard_normal(50).astype(np.float32) for i in range(6)]
    for g in grads[:3]:
        a.compress(g, "w")
    b = ReferenceCompressor.from_spec("randomk:density=0.2")
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        pa, ca = a.compress(g, "w")
        pb, cb = b.compress(g, "w")
        np.testing.assert_array_equal(pa, pb)
        np.testing.assert_array_equal(ca[0], cb[0])


def test_load_state_dict_checks_the_residual_size():
    a = hvd_torch.Compression.randomk(density=0.5)
    a.load_state_dict({0: {"residual": np.zeros(3, np.float32), "step": 2}})
    with pytest.raises(ValueError, match="saved residual of slot 0 has shape"):
        a.compress(torch.ones(4))
