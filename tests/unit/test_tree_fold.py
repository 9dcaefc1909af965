"""The binomial tree's reduction folded on one rank (exchange/tree.py's ``fold_like_the_tree``,
what gTop-k runs over Horovod's collectives) makes the same ``combine`` calls in the same order
as ``reduce_to_root`` over messages, at every P: here the ranks of ``reduce_to_root`` are
threads passing their payloads through queues, and ``combine`` writes down its order."""
import queue
import threading
from types import SimpleNamespace

import pytest

from horovod_sparse.exchange.tree import fold_like_the_tree, reduce_to_root


def reduced_over_messages(size, combine):
    """rank 0's result of ``reduce_to_root`` with payload ``str(rank)`` on ``size`` threads."""
    mailboxes = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
    results = [None] * size

    def rank_main(rank):
        def send(payload, dest):
            mailboxes[(rank, dest)].put(payload)

        def receive(source):
            return mailboxes[(source, rank)].get(timeout=10)

        comm = SimpleNamespace(size=size, rank=rank)
        results[rank] = reduce_to_root(comm, str(rank), send, receive, combine)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert all(r is None for r in results[1:])
    return results[0]


def in_order(mine, theirs):
    return f"({mine}+{theirs})"


@pytest.mark.parametrize("size", range(1, 10))
def test_the_fold_makes_the_trees_calls_in_the_trees_order(size):
    expected = reduced_over_messages(size, in_order)
    assert fold_like_the_tree([str(r) for r in range(size)], in_order) == expected
    assert sorted(expected.replace("(", "").replace(")", "").split("+"), key=int) == [str(r) for r in range(size)]


def test_the_order_at_five_ranks():
    """The extra rank folds in first, then the binomial tree over 0..3."""
    assert fold_like_the_tree([str(r) for r in range(5)], in_order) == "(((0+4)+1)+(2+3))"
