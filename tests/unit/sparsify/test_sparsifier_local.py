"""The Sparsifier on a single-rank communicator: API, state_dict contents, local errors."""
import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.sparsify import Sparsifier, StepInfo
from horovod_sparse.sparsify.selection import TopKRule

SPECS = ["topk", "topk:exchange=oktopk", "topk:exchange=gtopk", "topk:exchange=dsa", "oktopk",
         "oktopk:warmup_steps=2", "gtopk", "gaussiank", "threshold", "dgc"]


@pytest.mark.parametrize("spec", SPECS)
def test_step_returns_what_was_kept_and_state_is_numpy_and_ints(spec):
    n = 1000
    compressor = horovod_sparse.create(spec)
    rng = np.random.default_rng(0)
    with compressor.make_pipeline(n, MPI.COMM_SELF) as sparsifier:
        assert isinstance(sparsifier, Sparsifier) and sparsifier.last is None
        assert sparsifier.residual.dtype == np.float32 and sparsifier.residual.shape == (n,)
        for step in range(4):
            grad = rng.standard_normal(n).astype(np.float32)
            out = sparsifier.step(grad)
            info = sparsifier.last
            assert isinstance(info, StepInfo) and info.step == step
            expected = np.zeros(n, np.float32)
            expected[info.cleared_indices] = info.kept_values
            assert np.array_equal(out, expected)
            assert out is not sparsifier.residual and not np.shares_memory(out, sparsifier.residual)
        state = sparsifier.state_dict()
        assert state["step"] == 4 and "layout" not in state
        for key, value in state.items():
            assert isinstance(value, (int, np.ndarray, np.generic)), key
        assert (sparsifier.velocity is not None) == (spec == "dgc")


def test_load_state_dict_refuses_another_buffer_length():
    compressor = horovod_sparse.create("topk")
    with compressor.make_pipeline(10, MPI.COMM_SELF) as small, \
            compressor.make_pipeline(11, MPI.COMM_SELF) as large:
        with pytest.raises(ValueError, match="n=10"):
            large.load_state_dict(small.state_dict())


def test_float64_gradients_are_cast_and_wrong_shapes_refused():
    with horovod_sparse.create("topk", density=0.5).make_pipeline(4, MPI.COMM_SELF) as sparsifier:
        out = sparsifier.step(np.array([1.0, -4.0, 2.0, 0.5]))
        assert out.dtype == np.float32 and out.tolist() == [0.0, -4.0, 2.0, 0.0]
        with pytest.raises(ValueError, match="length n=4"):
            sparsifier.step(np.zeros(5, np.float32))


def test_sparsifier_refuses_the_dense_exchange_and_close_is_idempotent():
    with pytest.raises(ValueError, match="exchange must be one of"):
        Sparsifier(10, MPI.COMM_SELF, TopKRule(), 1, exchange="dense")
    sparsifier = Sparsifier(10, MPI.COMM_SELF, TopKRule(), 1)
    sparsifier.close()
    sparsifier.close()
    assert "rule=topk" in repr(sparsifier)


def test_input_gradient_is_never_modified():
    grad = np.arange(100, dtype=np.float32)
    grad.setflags(write=False)  # e.g. what tf.numpy_function hands over
    for spec in SPECS:
        with horovod_sparse.create(spec).make_pipeline(100, MPI.COMM_SELF) as sparsifier:
            sparsifier.step(grad)
            sparsifier.step(grad)
    assert np.array_equal(grad, np.arange(100, dtype=np.float32))


@pytest.mark.parametrize("spec", SPECS)
def test_pieces_step_like_their_fused_buffer(spec):
    """step(list of pieces) is step(the pieces concatenated), numpy or torch; wrong totals and
    shapes are refused before anything changes."""
    import torch
    sizes = [400, 7, 593]
    compressor = horovod_sparse.create(spec)
    rng = np.random.default_rng(3)
    with compressor.make_pipeline(1000, MPI.COMM_SELF) as fused, \
            compressor.make_pipeline(1000, MPI.COMM_SELF) as by_numpy, \
            compressor.make_pipeline(1000, MPI.COMM_SELF) as by_torch:
        for _ in range(3):
            pieces = [rng.standard_normal(size).astype(np.float32) for size in sizes]
            expected = fused.step(np.concatenate(pieces))
            assert np.array_equal(by_numpy.step(pieces), expected)
            assert np.array_equal(by_torch.step([torch.from_numpy(p) for p in pieces]).numpy(), expected)
        state = by_numpy.state_dict()
        with pytest.raises(ValueError, match="pieces of 999 elements in all"):
            by_numpy.step([np.zeros(400, np.float32), np.zeros(599, np.float32)])
        with pytest.raises(ValueError, match=r"got shape \(2, 5\)"):
            by_numpy.step([np.zeros((2, 5), np.float32), np.zeros(990, np.float32)])
        assert by_numpy.state_dict()["step"] == state["step"]
