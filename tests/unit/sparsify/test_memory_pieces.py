"""The memory's accumulate_pieces (what the PyTorch frontend uses: a step's gradients read where
they are) equals accumulate of the same gradients fused, bit for bit, and commits the same."""
import numpy as np
import pytest
import torch

from horovod_sparse.memory import ErrorFeedback, MomentumCorrection

SIZES = [300, 1, 0, 1000]


def pieces_of(rng, library, dtype):
    arrays = [rng.standard_normal(size).astype(np.float32) * 3 for size in SIZES]
    if library == "numpy":
        return [a.astype(dtype) for a in arrays]
    return [torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays]


def fused(pieces):
    """The reference: the pieces cast to float32 and concatenated (what a fused buffer holds)."""
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat([p.float() for p in pieces])
    return np.concatenate([p.astype(np.float32) for p in pieces])


def bits(x):
    return (x.numpy() if isinstance(x, torch.Tensor) else x).view(np.uint32)


@pytest.mark.parametrize("library, dtype", [("numpy", "float32"), ("numpy", "float64"), ("numpy", "float16"),
                                            ("torch", "float32"), ("torch", "float64"), ("torch", "float16"),
                                            ("torch", "bfloat16")])
@pytest.mark.parametrize("make", [lambda n: ErrorFeedback(n), lambda n: ErrorFeedback(n, enabled=False),
                                  lambda n: MomentumCorrection(n, 0.9)], ids=["ef", "no-ef", "dgc"])
def test_pieces_equal_the_fused_buffer_over_steps(library, dtype, make):
    n = sum(SIZES)
    by_pieces, by_buffer = make(n), make(n)
    rng = np.random.default_rng(7)
    for step in range(4):
        pieces = pieces_of(rng, library, dtype)
        acc_pieces = by_pieces.accumulate_pieces(pieces)
        acc_buffer = by_buffer.accumulate(fused(pieces))
        assert np.array_equal(bits(acc_pieces), bits(acc_buffer)), step
        cleared = np.arange(step, n, 7)
        if library == "torch":
            cleared = torch.from_numpy(cleared)
        for memory, acc in ((by_pieces, acc_pieces), (by_buffer, acc_buffer)):
            if memory.enabled:
                memory.commit_cleared(acc, cleared)
        assert np.array_equal(bits(by_pieces.residual), bits(by_buffer.residual)), step
        if isinstance(by_pieces, MomentumCorrection):
            assert np.array_equal(bits(by_pieces.velocity), bits(by_buffer.velocity)), step
