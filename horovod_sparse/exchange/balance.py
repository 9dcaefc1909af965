"""Phase 2 of Ok-Topk: rebalance the selected entries to equal counts, then Allgatherv.

After global selection rank j holds the selected entries of region j - possibly
very unequal counts.  Their concatenation in rank order is sorted by index.  We
cut that concatenation into P equal-count pieces, move each entry to the rank
owning its piece (point-to-point, only the excess moves), and Allgatherv the
balanced pieces so that no rank sends much more than k/P entries to everyone.
"""
import numpy as np

_TAG_INDICES, _TAG_VALUES = 201, 202


def balanced_allgatherv(comm, indices, values, counts, index_dtype):
    """Concatenate every rank's sorted selection, balancing the Allgatherv first.

    Parameters
    ----------
    comm : CountingComm
    indices, values : this rank's selected entries (int64 sorted, values).
    counts : int64 array, selected entries per rank (identical on all ranks).
    index_dtype : wire dtype of indices.

    Returns (int64 indices, values) of all selected entries, sorted by index,
    bitwise identical on every rank.
    """
    size, rank = comm.size, comm.rank
    total = int(counts.sum())
    if size == 1 or total == 0:
        return np.asarray(indices, dtype=np.int64), values
    held_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)    # who holds what
    target_start = np.array([(q * total) // size for q in range(size + 1)], dtype=np.int64)

    def overlap(holder, owner):
        lo = max(held_start[holder], target_start[owner])
        hi = min(held_start[holder + 1], target_start[owner + 1])
        return lo, hi

    wire_indices = np.asarray(indices).astype(index_dtype)
    requests, pieces = [], {}
    for peer in range(size):
        if peer == rank:
            continue
        lo, hi = overlap(rank, peer)
        if hi > lo:  # part of my holding belongs to peer's balanced piece
            part = slice(lo - held_start[rank], hi - held_start[rank])
            requests.append(comm.isend(np.ascontiguousarray(wire_indices[part]), peer, _TAG_INDICES))
            requests.append(comm.isend(np.ascontiguousarray(values[part]), peer, _TAG_VALUES))
        lo, hi = overlap(peer, rank)
        if hi > lo:  # part of peer's holding belongs to my balanced piece
            got_indices = np.empty(hi - lo, dtype=index_dtype)
            got_values = np.empty(hi - lo, dtype=values.dtype)
            requests.append(comm.irecv(got_indices, peer, _TAG_INDICES))
            requests.append(comm.irecv(got_values, peer, _TAG_VALUES))
            pieces[peer] = (got_indices, got_values)
    lo, hi = overlap(rank, rank)
    if hi > lo:
        part = slice(lo - held_start[rank], hi - held_start[rank])
        pieces[rank] = (wire_indices[part], values[part])
    comm.waitall(requests)

    # Holders are in rank order and their holdings are index-ordered, so
    # concatenating by holder rank keeps my balanced piece sorted.
    order = sorted(pieces)
    my_indices = np.concatenate([pieces[p][0] for p in order]) if order else np.empty(0, index_dtype)
    my_values = np.concatenate([pieces[p][1] for p in order]) if order else np.empty(0, values.dtype)
    balanced_counts = np.diff(target_start)
    all_indices = comm.allgatherv(my_indices, balanced_counts)
    all_values = comm.allgatherv(np.ascontiguousarray(my_values), balanced_counts)
    return all_indices.astype(np.int64), all_values
