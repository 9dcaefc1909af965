import numpy as np
import pytest

from horovod_sparse.ops import random_indices


@pytest.mark.parametrize("n,k", [(10, 3), (1000, 10), (25_000_000, 250_000), (5, 5), (5, 0), (0, 0)])
def test_distinct_sorted_in_range(n, k):
    idx = random_indices(1, 2, 3, n, k)
    assert idx.dtype == np.int64 and idx.shape == (k,)
    assert np.all(np.diff(idx) > 0)
    assert k == 0 or (idx[0] >= 0 and idx[-1] < n)


def test_depends_only_on_seed_stream_step():
    a = random_indices(1, 2, 3, 10_000, 100)
    np.testing.assert_array_equal(a, random_indices(1, 2, 3, 10_000, 100))
    for other in [(2, 2, 3), (1, 3, 3), (1, 2, 4)]:
        assert not np.array_equal(a, random_indices(*other, 10_000, 100))


def test_k_above_n_is_refused():
    with pytest.raises(ValueError, match="k must be in"):
        random_indices(0, 0, 0, 3, 4)


def test_covers_every_index_over_steps():
    """Every coordinate is eventually sent, which is what lets error feedback drain the residual."""
    seen = np.zeros(200, bool)
    for step in range(200):
        seen[random_indices(0, 0, step, 200, 10)] = True
    assert seen.all()
