"""The same Sparsifier code on torch tensors and on numpy arrays: the same bits, every step.

Two sparsifiers of one compressor run side by side on every rank, one fed numpy arrays,
one fed torch tensors (CPU) holding the same gradients. Everything they return or keep
must agree bit for bit (the selections compare integer keys, the exchange is the same
numpy code, the memory's float32 adds are elementwise); the torch results stay torch
tensors, and are bitwise identical on every rank.
"""
import numpy as np
import pytest
import torch

import horovod_sparse
from horovod_sparse.ops import host
from sparsify_oracles import RANK, bitwise_equal, gradient, on_every_rank

SPECS = ["topk:density=0.02", "topk:density=0.02,exchange=oktopk", "topk:density=0.02,exchange=gtopk",
         "topk:density=0.02,exchange=dsa", "topk:density=0.02,error_feedback=False",
         "oktopk:density=0.02,tau_prime=3", "oktopk:density=0.02,warmup_steps=1", "gtopk:density=0.02",
         "gaussiank:density=0.02", "gaussiank:density=0.02,exchange=dsa", "threshold:value=1.5",
         "dgc:density=0.02,sample_fraction=0.05", "dgc:density=0.02,exchange=dsa"]
N = 20_000
STEPS = 8


def as_numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize("spec", SPECS)
def test_torch_steps_equal_numpy_steps_bitwise(spec, comm, assert_identical_across_ranks):
    compressor = horovod_sparse.create(spec)
    kind = "heavy" if spec.startswith(("gaussiank", "dgc")) else "normal"
    with compressor.make_pipeline(N, comm) as on_numpy, compressor.make_pipeline(N, comm) as on_torch:
        for step in range(STEPS):
            grad = gradient(N, step, RANK, kind)
            expected = on_numpy.step(grad, tag=5)
            got = on_torch.step(torch.from_numpy(grad.copy()), tag=5)
            mine, theirs = on_torch.last, on_numpy.last

            def agree():
                assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
                assert bitwise_equal(got.numpy(), expected), f"step {step}: results differ"
                for field in ("local_indices", "sent_values", "selected", "cleared_indices", "kept_values"):
                    assert isinstance(getattr(mine, field), torch.Tensor), field
                    assert bitwise_equal(as_numpy(getattr(mine, field)), as_numpy(getattr(theirs, field))), field
                assert mine.method == theirs.method and mine.traffic == theirs.traffic
                assert bitwise_equal(as_numpy(on_torch.residual), as_numpy(on_numpy.residual))
                if on_numpy.velocity is not None:
                    assert bitwise_equal(as_numpy(on_torch.velocity), as_numpy(on_numpy.velocity))

            on_every_rank(agree)
            assert_identical_across_ranks(got.numpy())
        # Checkpoints are numpy whatever the buffers' library, and the same.
        numpy_state, torch_state = on_numpy.state_dict(), on_torch.state_dict()

        def same_state():
            assert set(numpy_state) == set(torch_state)
            for key, value in torch_state.items():
                assert isinstance(value, (int, np.ndarray, np.generic)), (key, type(value))
                assert bitwise_equal(np.asarray(value), np.asarray(numpy_state[key])), key

        on_every_rank(same_state)


@pytest.mark.parametrize("spec", ["topk:density=0.02", "oktopk:density=0.02", "gtopk:density=0.02",
                                  "gaussiank:density=0.02", "dgc:density=0.02"])
def test_step_sparse_is_step_without_densifying(spec, comm, assert_identical_across_ranks):
    """step_sparse returns the sorted support and its sums; step is exactly that, densified."""
    compressor = horovod_sparse.create(spec)
    with compressor.make_pipeline(N, comm) as sparse, compressor.make_pipeline(N, comm) as dense:
        for step in range(4):
            grad = torch.from_numpy(gradient(N, step, RANK))
            indices, values = sparse.step_sparse(grad, tag=1)
            out = dense.step(grad, tag=1)

            def checks():
                assert indices.dtype == torch.int64 and values.dtype == torch.float32
                assert indices.shape == values.shape and indices.numel() < N // 4
                assert bool(torch.all(indices[1:] > indices[:-1]))
                densified = torch.zeros(N)
                densified[indices] = values
                assert bitwise_equal(densified.numpy(), out.numpy())

            on_every_rank(checks)
            assert_identical_across_ranks(indices.numpy())
            assert_identical_across_ranks(values.numpy())


def test_only_the_pairs_cross_to_the_host(comm):
    """What the step moves through host.to_host/from_host: the selected pairs out, the
    summed pairs in (Gaussiank adds its small sample), never the n-element buffer."""
    n = 200_000
    for spec in ["topk:density=0.01", "oktopk:density=0.01", "gtopk:density=0.01",
                 "gaussiank:density=0.01", "dgc:density=0.01", "threshold:value=12"]:
        with horovod_sparse.create(spec).make_pipeline(n, comm) as sparsifier:
            for step in range(3):
                host.HOST_TRAFFIC.reset()
                indices, _ = sparsifier.step_sparse(torch.from_numpy(gradient(n, step, RANK)))
                info = sparsifier.last
            pairs_out = info.local_indices.numel() * (8 + 4)
            pairs_in = indices.numel() * (8 + 4)
            # Gaussiank's sample: every ceil(n / 4096)-th float32 entry.
            sample = 4 * len(range(0, n, -(-n // 4096))) if spec.startswith("gaussiank") else 0
            expected_out = pairs_out + sample

            def checks():
                assert host.HOST_TRAFFIC.bytes_out == expected_out, (spec, host.HOST_TRAFFIC.bytes_out)
                assert host.HOST_TRAFFIC.bytes_in == pairs_in, (spec, host.HOST_TRAFFIC.bytes_in)
                if not spec.startswith("threshold"):  # a fixed threshold's count is anything
                    assert host.HOST_TRAFFIC.bytes < 4 * n / 4, spec  # a quarter of the buffer, at 1%

            on_every_rank(checks)
