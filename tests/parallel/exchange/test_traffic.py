"""Byte counters: measured per-rank volume against the papers' formulas."""
import numpy as np

from exchange_helpers import RANK, SIZE, all_ranks, random_sparse
from horovod_sparse.exchange import SparseAllreduce, Traffic

PAIR_BYTES = 4 + 4  # int32 index + float32 value (n < 2**31)


def test_topka_moves_exactly_2k_times_p_minus_1_pairs():
    n, k = 100_000, 500
    indices, values = random_sparse(n, k, seed=RANK)
    with SparseAllreduce(n, "allgather") as ex:
        t = ex.allreduce(indices, values).traffic
    pairs = t.payload_bytes / PAIR_BYTES
    print(f"[rank {RANK}] TopkA P={SIZE} k={k}: {pairs:.0f} pairs, 2k(P-1) = {2 * k * (SIZE - 1)}")
    assert all_ranks(t.payload_bytes == 2 * k * (SIZE - 1) * PAIR_BYTES)
    assert all_ranks(t.payload_bytes_sent == t.payload_bytes_received == k * (SIZE - 1) * PAIR_BYTES)


def test_oktopk_stays_under_6k_times_p_minus_1_over_p_pairs():
    n, k, steps = 200_000, 2000, 5
    with SparseAllreduce(n, "oktopk", k=k) as ex:
        per_step = []
        for step in range(steps):
            indices, values = random_sparse(n, k, seed=31 * step + RANK)
            per_step.append(ex.allreduce(indices, values).traffic)
    bound = 6 * k * (SIZE - 1) / SIZE
    # Step 0 repartitions the regions; from step 1 on they are balanced.
    balanced = per_step[1:]
    payload_pairs = [t.payload_bytes / PAIR_BYTES for t in balanced]
    total_pairs = [t.total_bytes / PAIR_BYTES for t in balanced]  # control bytes included
    print(f"[rank {RANK}] Ok-Topk P={SIZE} k={k}: payload pairs per step {payload_pairs}, "
          f"with control {total_pairs}, bound 6k(P-1)/P = {bound:.0f}, "
          f"2k(P-1) (TopkA) = {2 * k * (SIZE - 1)}")
    assert all_ranks(all(p <= bound for p in payload_pairs))
    assert all_ranks(all(p <= bound for p in total_pairs))
    if SIZE > 3:  # 6k(P-1)/P < 2k(P-1) once P > 3: then Ok-Topk beats TopkA's volume
        assert all_ranks(max(payload_pairs) < 2 * k * (SIZE - 1))


def test_dense_counts_ring_volume_and_counters_add_up():
    n = 10_000
    indices, values = random_sparse(n, 100, seed=RANK)
    with SparseAllreduce(n, "dense") as ex:
        first = ex.allreduce(indices, values).traffic
        second = ex.allreduce(indices, values).traffic
        cumulative = ex.traffic
    own_chunk = ((RANK + 1) * n) // SIZE - (RANK * n) // SIZE
    assert all_ranks(first.payload_bytes_sent == 2 * (n - own_chunk) * 4)
    assert all_ranks(first == second)
    assert all_ranks(cumulative == first + second)
    assert all_ranks(cumulative - second == first)
    assert all_ranks(isinstance(cumulative, Traffic))
    for t in (first, cumulative):
        assert all_ranks(all(isinstance(getattr(t, f), int) for f in
                             ("bytes_sent", "bytes_received", "messages_sent", "messages_received")))


def test_every_algorithm_counts_messages_and_bytes():
    n = 5000
    indices, values = random_sparse(n, 200, seed=RANK)
    for algorithm in ("allgather", "oktopk", "gtopk", "dsa"):
        with SparseAllreduce(n, algorithm, k=100) as ex:
            t = ex.allreduce(indices, values).traffic
        if SIZE == 1:
            assert all_ranks(t == Traffic())
        else:
            assert all_ranks(t.bytes_sent > 0 and t.bytes_received > 0)
            assert all_ranks(t.messages_sent > 0 and t.messages_received > 0)
            assert all_ranks(0 < t.control_bytes_sent < t.bytes_sent)
