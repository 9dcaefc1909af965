"""The engine on recorded top-k selections of real training, every algorithm: its sums equal
an independent oracle's, and its byte and message counters equal the closed forms of
horovod_sparse.whatif.volumes, on every rank (fed the regions, overlaps and selected counts
the data decide), and exactly on a constructed case where the (n, k, P) form alone is exact."""
from pathlib import Path

import numpy as np
import pytest

from exchange_helpers import COMM, RANK, SIZE, all_ranks, close_to, dense_oracle, identical_on_all_ranks
from horovod_sparse.exchange import ALGORITHMS, SparseAllreduce
from horovod_sparse.whatif import volumes

SELECTIONS = Path(__file__).resolve().parents[3] / "docs/results/data/oktopk-scale/selections.npz"
STEP_ROW = 1  # the middle recorded step
CALLS = 2     # Ok-Topk: the first call repartitions and takes the exact threshold, the second reuses both


def _load():
    with np.load(SELECTIONS) as f:
        if SIZE > f["indices"].shape[1]:
            pytest.skip(f"the recording holds {f['indices'].shape[1]} ranks, fewer than {SIZE}")
        idx, vals = f["indices"][STEP_ROW, :SIZE], f["values"][STEP_ROW, :SIZE]
        return [i.astype(np.int64) for i in idx], list(vals), int(f["n"]), int(f["k"])


@pytest.fixture(scope="module")
def recorded():
    return _load()


@pytest.fixture(scope="module")
def runs(recorded):
    """{algorithm: [(result, traffic) per call]} of the engine on this rank's recorded selection."""
    selections, values, n, k = recorded
    out = {}
    for algorithm in ALGORITHMS:
        with SparseAllreduce(n, algorithm, k=k) as ex:
            out[algorithm] = [(res, res.traffic) for res in
                              (ex.allreduce(selections[RANK], values[RANK]) for _ in range(CALLS))]
    return out


def brute_top_k(total, k):
    """Sorted indices of the k largest |float32(total)|, ties to the lower index."""
    magnitude = np.abs(total.astype(np.float32)).astype(np.float64)
    return np.sort(np.lexsort((np.arange(total.size), -magnitude))[:k])


def gtopk_oracle(selections, values, k):
    """gTop-k's own rule, recomputed with numpy: every rank's top-k, folded along the engine's
    tree (ranks >= the largest power of two first, then a binomial tree to rank 0), each merge
    summing in float64, rounding to float32 and keeping the k largest |sum| (ties: lower index)."""
    def keep_top(indices, vals):
        if indices.size <= k:
            return indices, vals
        order = np.lexsort((indices, -np.abs(vals.astype(np.float64))))[:k]
        order.sort()
        return indices[order], vals[order]

    def merge(mine, theirs):
        indices = np.concatenate([mine[0], theirs[0]])
        vals = np.concatenate([mine[1], theirs[1]]).astype(np.float64)
        support, inverse = np.unique(indices, return_inverse=True)
        sums = np.zeros(support.size)
        np.add.at(sums, inverse, vals)
        return keep_top(support, sums.astype(np.float32))

    payload = [keep_top(s, v) for s, v in zip(selections, values)]
    size = len(payload)
    power = 1 << (size.bit_length() - 1)
    for r in range(power, size):
        payload[r - power] = merge(payload[r - power], payload[r])
    distance = 1
    while distance < power:
        for r in range(0, power, 2 * distance):
            payload[r] = merge(payload[r], payload[r + distance])
        distance *= 2
    return payload[0][0]


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "dsa"])
def test_exact_algorithms_equal_the_oracle(algorithm, recorded, runs):
    selections, values, n, _ = recorded
    expected = dense_oracle(n, selections[RANK], values[RANK])
    for res, _ in runs[algorithm]:
        assert all_ranks(close_to(res.dense(), expected))
        assert all_ranks(set(np.flatnonzero(expected)) <= set(res.indices.tolist()))
        assert identical_on_all_ranks(res.indices, res.values)


def test_oktopk_selects_the_k_largest_sums(recorded, runs):
    selections, values, n, k = recorded
    expected = dense_oracle(n, selections[RANK], values[RANK])
    truth = brute_top_k(expected, k)
    for res, _ in runs["oktopk"]:  # exact threshold, then the same threshold on the same input
        assert all_ranks(np.array_equal(res.selected, truth))
        assert all_ranks(close_to(res.values, expected[res.selected]))
        assert identical_on_all_ranks(res.indices, res.values, res.selected)


def test_gtopk_follows_its_tree_rule(recorded, runs):
    selections, values, n, k = recorded
    expected = dense_oracle(n, selections[RANK], values[RANK])
    truth = gtopk_oracle(selections, values, k)
    for res, _ in runs["gtopk"]:
        assert all_ranks(np.array_equal(res.selected, truth))
        assert all_ranks(close_to(res.values, expected[res.selected]))  # the full sums, not the truncated
        assert identical_on_all_ranks(res.indices, res.values, res.selected)


def _fed(algorithm, selections, values, n, k, call, result):
    if algorithm == "dsa":
        return dict(stats=volumes.data_stats(selections, [(j * n) // SIZE for j in range(SIZE + 1)]))
    if algorithm == "oktopk":
        bounds = volumes.oktopk_bounds(selections, n)
        return dict(stats=volumes.data_stats(selections, bounds), repartition=call == 0, exact=call == 0,
                    selected_per_region=volumes.selected_per_region(selections, values, bounds, k))
    if algorithm == "gtopk":
        return dict(selected=result.selected.size)
    return {}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_counters_equal_the_closed_form_fed_the_data(algorithm, recorded, runs):
    selections, values, n, k = recorded
    for call, (res, t) in enumerate(runs[algorithm]):
        v = volumes.volume(algorithm, n, k, SIZE, RANK, **_fed(algorithm, selections, values, n, k, call, res))
        counted = (t.bytes_sent, t.bytes_received, t.messages_sent, t.messages_received)
        assert all_ranks(counted == (v.bytes_sent, v.bytes_received, v.messages_sent, v.messages_received)), \
            f"{algorithm} call {call} rank {RANK}: counted {counted}, closed form {v}"


def test_oktopk_stays_within_5_percent_of_the_closed_form_and_below_the_paper(recorded, runs):
    selections, values, n, k = recorded
    sent = np.array([t.bytes_sent for _, t in runs["oktopk"]], dtype=float)
    mean = COMM.allreduce(sent) / SIZE
    for call, m in enumerate(mean):
        model = volumes.oktopk(n, k, SIZE, repartition=call == 0, exact=call == 0).bytes_sent
        assert all_ranks(abs(m / model - 1) < 0.05), f"call {call}: {m} vs {model}"
        assert all_ranks(m < 4 * volumes.paper_elements("oktopk", n, k, SIZE))


def _disjoint(rank, k):
    """Rank ``rank``'s constructed selection: 4 (rank + j P), j < k, values +-(1 + rank)."""
    values = np.full(k, 1.0 + rank, dtype=np.float32) * np.where(np.arange(k) % 2, 1, -1).astype(np.float32)
    return np.arange(rank, k * SIZE, SIZE, dtype=np.int64) * 4, values


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_counters_equal_the_closed_form_on_disjoint_equal_selections(algorithm):
    # Rank r holds 4 (r + j P), j < k: disjoint, k each, spread evenly, so every region gets
    # k/P entries of every rank and the highest rank's k entries are the k largest. Dense,
    # TopkA and gTop-k are then exact from (n, k, P) alone; TopkDSA and Ok-Topk are given the
    # union (P k, not the independent-uniform union) and Ok-Topk its averaged cut points.
    P, k = SIZE, 64 * SIZE
    n = 4 * k * P
    indices, values = _disjoint(RANK, k)
    with SparseAllreduce(n, algorithm, k=k) as ex:
        t = ex.allreduce(indices, values).traffic
    everyone = [_disjoint(r, k) for r in range(P)]
    selections = [e[0] for e in everyone]
    if algorithm == "oktopk":
        bounds = volumes.oktopk_bounds(selections, n)
        v = volumes.oktopk(n, k, P, RANK, stats=volumes.data_stats(selections, bounds), repartition=True,
                           exact=True, selected_per_region=volumes.selected_per_region(
                               selections, [e[1] for e in everyone], bounds, k))
    elif algorithm == "dsa":
        v = volumes.dsa(n, k, P, RANK, stats=volumes.data_stats(selections, [(j * n) // P for j in range(P + 1)]))
    else:
        v = volumes.volume(algorithm, n, k, P, RANK)
    counted = (t.bytes_sent, t.bytes_received, t.messages_sent, t.messages_received)
    assert all_ranks(counted == (v.bytes_sent, v.bytes_received, v.messages_sent, v.messages_received)), \
        f"{algorithm} rank {RANK}: counted {counted}, closed form {v}"
    if algorithm == "allgather":  # the paper's 2k(P-1) elements of 4 bytes, plus the header
        assert all_ranks(t.bytes_sent == 4 * volumes.paper_elements("allgather", n, k, P) + 80 * (P - 1))
