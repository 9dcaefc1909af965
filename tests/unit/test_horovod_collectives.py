"""The parts of HorovodCollectives that need no Horovod: its reading of mpi4py's buffer specs
(``(buf, counts)``, ``[buf, (counts, displs)]``), the packing of blocks at displacements, and
the transport setting, and TensorFlow's refusal outside eager execution. The collectives
themselves run for real in tests/parallel/gloo (under ``horovodrun --gloo``),
tests/parallel/torch/test_transports.py (under mpirun) and tests/parallel/worlds."""
import numpy as np
import pytest

from horovod_sparse.errors import HorovodWorldError
from horovod_sparse.horovod_collectives import _packed_bytes, _place, _spec, _TensorFlowCollectives
from horovod_sparse.world import transport_setting


def test_counts_alone_are_packed_one_after_the_other():
    buf = np.zeros(7, np.int64)
    assert _spec((buf, np.array([3, 4]))) == (buf, [3, 4], [0, 3])
    assert _spec((buf, [2, 0, 5]))[1:] == ([2, 0, 5], [0, 2, 2])


def test_counts_and_displacements_are_read_as_given():
    buf = np.zeros(9, np.float32)
    assert _spec([buf, ([2, 3], [4, 0])])[1:] == ([2, 3], [4, 0])
    assert _spec([buf, (np.array([1, 1]), np.array([0, 1]))])[1:] == ([1, 1], [0, 1])


def test_blocks_at_displacements_are_packed_and_placed_back():
    buf = np.arange(10, dtype=np.float32)
    packed = _packed_bytes(buf, [2, 3], [6, 1])
    np.testing.assert_array_equal(packed.view(np.float32), [6, 7, 1, 2, 3])
    out = np.full(10, -1, np.float32)
    _place(out, packed, [2, 3], [6, 1])
    np.testing.assert_array_equal(out, [-1, 1, 2, 3, -1, -1, 6, 7, -1, -1])


def test_contiguous_blocks_are_sent_without_a_copy():
    buf = np.arange(6, dtype=np.int32)
    packed = _packed_bytes(buf, [2, 4], [0, 2])
    assert np.shares_memory(packed, buf) and packed.size == 24


def test_structured_records_travel_as_their_bytes():
    record = np.dtype([("i", np.int32), ("v", np.float32)])
    mine = np.zeros(3, record)
    mine["i"], mine["v"] = [1, 2, 3], [0.5, 1.5, 2.5]
    out = np.empty(3, record)
    _place(out, _packed_bytes(mine, [3], [0]), [3], [0])
    assert out.tobytes() == mine.tobytes()


def test_a_receive_buffer_must_be_contiguous():
    with pytest.raises(ValueError, match="must be contiguous"):
        _place(np.zeros((4, 4), np.float32)[:, 0], np.zeros(8, np.uint8), [2], [0])


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("MPI", "mpi"), (" horovod ", "horovod")])
def test_the_transport_setting(value, expected):
    assert transport_setting({} if value is None else {"HOROVOD_SPARSE_TRANSPORT": value}) == expected


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match=r"HOROVOD_SPARSE_TRANSPORT must be one of"):
        transport_setting({"HOROVOD_SPARSE_TRANSPORT": "gloo"})


def test_tensorflow_without_eager_execution_raises_before_any_collective():
    """A TF1-style graph (a plain ``tf.Graph``, as a Session runs) cannot run Horovod's eager
    collectives: HorovodWorldError saying so and what to launch instead, before Horovod is asked
    (it is not even initialised here). Under a real --gloo launch every rank raises it while the
    step is built (tried: hvd.DistributedOptimizer's minimize after disable_eager_execution)."""
    tf = pytest.importorskip("tensorflow")
    import horovod.tensorflow as hvd
    with tf.Graph().as_default(), pytest.raises(HorovodWorldError, match=r"only where TensorFlow executes eagerly.*"
                                                                       r"launch through MPI"):
        _TensorFlowCollectives(hvd).allgather(np.zeros(4, np.uint8), name="x", process_set=hvd.global_process_set)
