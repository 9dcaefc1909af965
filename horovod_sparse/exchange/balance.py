"""Phase 2 of Ok-Topk: rebalance the selected entries to equal counts, then Allgatherv.

After global selection rank j holds the selected entries of region j - possibly
very unequal counts.  Their concatenation in rank order is sorted by index.  We
cut that concatenation into P equal-count pieces, move each entry to the rank
owning its piece (point-to-point, only the excess moves), and Allgatherv the
balanced pieces so that no rank sends much more than k/P entries to everyone.
"""
import numpy as np

from .seeds import derive_seed

_TAG_INDICES, _TAG_VALUES = 201, 202


def balanced_allgatherv(comm, indices, values, counts, index_dtype, codec=None, seed=0):
    """Concatenate every rank's sorted selection, balancing the Allgatherv first.

    Parameters
    ----------
    comm : CountingComm
    indices, values : this rank's selected entries (int64 sorted, values).
    counts : int64 array, selected entries per rank (identical on all ranks).
    index_dtype : wire dtype of indices.
    codec : None, or a ValueCodec: values then travel as codes (see
        :func:`_balanced_allgatherv_codes`) and come back decoded, float32.
    seed : base seed of a stochastic codec (the engine's call seed).

    Returns (int64 indices, values) of all selected entries, sorted by index,
    bitwise identical on every rank.
    """
    if codec is not None:
        return _balanced_allgatherv_codes(comm, indices, values, counts, index_dtype, codec, seed)
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
    all_indices, all_values = comm.allgatherv_pairs(my_indices, my_values, balanced_counts)
    return all_indices.astype(np.int64), all_values


def _pieces(counts, size):
    """(held_start, target_start, overlap(holder, owner) -> (lo, hi)) of the balancing."""
    total = int(counts.sum())
    held_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    target_start = np.array([(q * total) // size for q in range(size + 1)], dtype=np.int64)

    def overlap(holder, owner):
        lo = max(held_start[holder], target_start[owner])
        hi = min(held_start[holder + 1], target_start[owner + 1])
        return int(lo), int(max(hi, lo))
    return held_start, target_start, overlap


def _balanced_allgatherv_codes(comm, indices, values, counts, index_dtype, codec, seed):
    """:func:`balanced_allgatherv` with values carried as codes, each encoded exactly once.

    The holder of a selected entry (the owner of its region) encodes each sub-piece
    of its holding that goes to one balanced owner separately (``codec.encode`` of
    those values); the balanced owner forwards the received codes unchanged, in holder
    order, through the Allgatherv (no decode/re-encode, so no second rounding), and
    every rank decodes every sub-piece - the sizes follow from ``counts`` alone. All
    ranks, the holders included, thus use the same decoded floats.
    """
    size, rank = comm.size, comm.rank
    if int(counts.sum()) == 0:
        return np.asarray(indices, dtype=np.int64), np.empty(0, np.float32)
    held_start, target_start, overlap = _pieces(counts, size)
    wire_indices = np.asarray(indices).astype(index_dtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    requests, pieces = [], {}
    for peer in range(size):
        lo, hi = overlap(rank, peer)
        if hi > lo:  # part of my holding belongs to peer's balanced piece: encode it once
            part = slice(lo - held_start[rank], hi - held_start[rank])
            codes = codec.encode(values[part], derive_seed(seed, rank, peer, 2))
            if peer == rank:
                pieces[rank] = (wire_indices[part], codes)
            else:
                requests.append(comm.isend(np.ascontiguousarray(wire_indices[part]), peer, _TAG_INDICES))
                requests.append(comm.isend(codes, peer, _TAG_VALUES))
        if peer == rank:
            continue
        lo, hi = overlap(peer, rank)
        if hi > lo:
            got_indices = np.empty(hi - lo, dtype=index_dtype)
            got_codes = np.empty(codec.nbytes(hi - lo), dtype=np.uint8)
            requests.append(comm.irecv(got_indices, peer, _TAG_INDICES))
            requests.append(comm.irecv(got_codes, peer, _TAG_VALUES))
            pieces[peer] = (got_indices, got_codes)
    comm.waitall(requests)

    order = sorted(pieces)
    my_indices = np.concatenate([pieces[p][0] for p in order]) if order else np.empty(0, index_dtype)
    my_codes = np.concatenate([pieces[p][1] for p in order]) if order else np.empty(0, np.uint8)
    # sub-piece sizes (holder h -> owner q), known identically on every rank
    sub = [[max(0, overlap(h, q)[1] - overlap(h, q)[0]) for h in range(size)] for q in range(size)]
    byte_counts = [sum(codec.nbytes(c) for c in row if c) for row in sub]
    all_indices = comm.allgatherv(my_indices, np.diff(target_start))
    all_codes = comm.allgatherv(my_codes, byte_counts)
    decoded, offset = [], 0
    for row in sub:
        for c in row:
            if c:
                nb = codec.nbytes(c)
                decoded.append(codec.decode(all_codes[offset:offset + nb], c))
                offset += nb
    all_values = np.concatenate(decoded) if decoded else np.empty(0, np.float32)
    return all_indices.astype(np.int64), all_values
