"""Rank-0 checkpoints: ``gather_state`` on every rank, one file written by rank 0
with ``torch.save``, read back by rank 0 alone, ``scatter_state`` on every rank. With every
``schedule=`` (``auto`` saved before and after it settles) the resumed run gives bitwise
the parameters of the uninterrupted one; a damaged or incompatible checkpoint fails with
the same error on every rank, and no rank waits in a collective.
"""
import pytest
import torch

import horovod.torch as hvd
import numpy as np
import horovod_sparse.torch as hvds
from horovod_sparse import state_format
from horovod_sparse.agreement import allgather_text, communicator_of
from horovod_sparse.checkpoint import gather_state, scatter_state

from test_schedules import distributed, five_layers, flat, scheduled, settle, train_step

pytestmark = pytest.mark.world_sizes(2, 3)  # per-rank state gathered and scattered over more than two ranks

STEPS = 7
SAVE_AT = 4


def save_and_load(compression, path):
    """gather_state, rank 0 writes and reads back the file, scatter_state-ready object on rank 0."""
    state = gather_state(compression)
    if hvd.rank() == 0:
        torch.save({"compression": state}, path)
        return torch.load(path, weights_only=False)["compression"]
    return None


def same_error_on_every_rank(call):
    """Run ``call``; it must raise ValueError on every rank, with the same text everywhere."""
    with pytest.raises(ValueError) as caught:
        call()
    texts = allgather_text(communicator_of(None), str(caught.value))
    assert all(text == texts[0] for text in texts), texts
    return texts[0]


def resume(spec, schedule, saved, model_state, opt_state):
    resumed, again = five_layers(), scheduled(spec, schedule)
    resumed.load_state_dict(model_state)
    opt = distributed(resumed, again)
    opt.load_state_dict(opt_state)
    scatter_state(again, saved)
    return resumed, opt, again


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "qsgd"])
@pytest.mark.parametrize("schedule", ["after_backward", "wfbp", "mgwfbp", "optimal", "asc"])
def test_rank0_checkpoint_resumes_every_schedule_bit_for_bit(spec, schedule, tmp_path,
                                                             assert_identical_across_ranks):
    model, compression = five_layers(), scheduled(spec, schedule)
    opt = distributed(model, compression)
    for step in range(STEPS):
        if step == SAVE_AT:
            model_state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state = opt.state_dict()
            saved = save_and_load(compression, tmp_path / "ckpt.pt")
        train_step(model, opt, step)
    compression.close()
    if hvd.rank() == 0 and schedule != "after_backward":
        assert all(part["(fused)"]["plan"]["keys"] for part in saved["ranks"]), "the plan is saved"

    resumed, opt, again = resume(spec, schedule, saved, model_state, opt_state)
    for step in range(SAVE_AT, STEPS):
        train_step(resumed, opt, step)
    if schedule != "after_backward":
        assert again.schedule_report is None, "a resumed run takes the saved plan, it does not profile again"
    again.close()
    np.testing.assert_array_equal(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["trying", "settled"])
def test_rank0_checkpoint_of_auto_before_and_after_it_settles(when, tmp_path, assert_identical_across_ranks):
    """Settled: the kept plan resumes bit for bit. Trying: the residuals come back and the
    resumed run profiles and tries again (the same on every rank)."""
    spec = "topk:density=0.05"
    model, compression = five_layers(), scheduled(spec, "auto")
    opt = distributed(model, compression)
    train_step(model, opt, 0)  # planned: the candidates run from the next step
    step = 1 if when == "trying" else settle(model, opt, compression, 1)
    assert (compression.schedule_report["chosen"] is None) == (when == "trying")
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    before = compression.state_dict()
    saved = save_and_load(compression, tmp_path / "ckpt.pt")
    for s in range(step, step + 3):
        train_step(model, opt, s)
    compression.close()

    resumed, opt, again = resume(spec, "auto", saved, model_state, opt_state)
    for name, fields in again.state_dict().items():  # every rank got its own residuals back
        if name != "(fused)":
            for field, value in fields.items():
                np.testing.assert_array_equal(value, before[name][field], err_msg=f"{name} {field}")
    for s in range(step, step + 3):
        train_step(resumed, opt, s)
    if when == "settled":
        assert again.schedule_report is None, "a settled plan is resumed as it was"
        np.testing.assert_array_equal(flat(resumed), flat(model))
    else:
        assert again.schedule_report is not None, "saved while trying: it profiles and tries again"
    again.close()
    assert_identical_across_ranks(flat(resumed))


def test_every_compressor_state_is_in_the_one_format():
    """state_dict() of a trained compressor, with and without a schedule, encodes and decodes
    bit for bit in the checkpoint format (numbers, strings, numeric arrays)."""
    for compression in (hvds.Compression.randomk(density=0.1), hvds.Compression.powersgd(),
                        scheduled("topk:density=0.05", "mgwfbp"), scheduled("fft", "after_backward")):
        model = five_layers()
        opt = distributed(model, compression)
        for step in range(3):
            train_step(model, opt, step)
        state = compression.state_dict()
        again = state_format.decode(state_format.encode(state))
        assert _equal(state, again), compression
        getattr(compression, "close", lambda: None)()


def _equal(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.timeout(120)
def test_a_damaged_part_is_refused_with_the_same_error_on_every_rank(tmp_path):
    compression = scheduled("topk:density=0.05", "wfbp")
    model = five_layers()
    opt = distributed(model, compression)
    for step in range(3):
        train_step(model, opt, step)
    saved = save_and_load(compression, tmp_path / "ckpt.pt")
    if hvd.rank() == 0:  # the last rank's part holds something that is not a number
        saved["ranks"][-1]["0.weight"]["memory_residual"] = object()
    text = same_error_on_every_rank(lambda: scatter_state(compression, saved))
    assert "damaged" in text and "0.weight" in text
    compression.close()


@pytest.mark.timeout(120)
def test_another_compressors_state_is_refused_with_the_same_error_on_every_rank(tmp_path):
    compression = hvds.Compression.topk(density=0.05)
    model = five_layers()
    opt = distributed(model, compression)
    train_step(model, opt, 0)
    saved = save_and_load(compression, tmp_path / "ckpt.pt")
    text = same_error_on_every_rank(lambda: scatter_state(hvds.Compression.qsgd(), saved))
    assert "saved by 'topk'" in text
    compression.close()


@pytest.mark.timeout(120)
def test_a_part_one_rank_cannot_load_fails_on_every_rank_at_the_first_step(tmp_path):
    """The last rank's residual has the wrong length: its load is deferred to the first step
    (the pipeline does not exist yet), where every rank raises the same error."""
    model, compression = five_layers(), hvds.Compression.topk(density=0.05)
    opt = distributed(model, compression)
    for step in range(2):
        train_step(model, opt, step)
    saved = save_and_load(compression, tmp_path / "ckpt.pt")
    compression.close()
    if hvd.rank() == 0:  # every per-element field of one gradient, one element short
        part = saved["ranks"][-1]["0.weight"]
        part.update({field: value[:-1] for field, value in part.items() if np.ndim(value) == 1})
    model, again = five_layers(), hvds.Compression.topk(density=0.05)
    opt = distributed(model, again)
    scatter_state(again, saved)
    text = same_error_on_every_rank(lambda: train_step(model, opt, 2))
    assert "0.weight" in text
    again.close()
