"""What a compressor's state carries into a new world (horovod_sparse.torch.elastic): from one
surviving rank, for every rank, the step counters and auto's decision (shared_part); from each
rank, its own gradients' per-element fields (own_part); the whole-buffer state (the exchange's
counters and world size, PowerSGD's Q's) starts afresh. The elastic jobs themselves run in
test_elastic_launch.py."""
import numpy as np

from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.torch.elastic import ElasticReport, carried_across_resize, own_part, shared_part
from horovod_sparse.torch.out_of_band import STEPS_KEY

RESIDUAL = np.arange(4, dtype=np.float32)
STATE = {"0.weight": {"memory_residual": RESIDUAL},
         PIPELINE_KEY: {"step": 12, "engine_world_size": 3, "engine_calls": 12, "q_0": np.ones((4, 2)), "layout": "x"},
         STEPS_KEY: {"step": 14}}


def test_every_rank_takes_the_counters_and_keeps_its_own_fields():
    assert shared_part(STATE) == {PIPELINE_KEY: {"step": 12}, STEPS_KEY: {"step": 14}}
    assert own_part(STATE) == {"0.weight": {"memory_residual": RESIDUAL}}
    carried = carried_across_resize(shared_part(STATE), own_part(STATE))
    assert carried == {"0.weight": {"memory_residual": RESIDUAL}, PIPELINE_KEY: {"step": 12}, STEPS_KEY: {"step": 14}}
    assert carried["0.weight"]["memory_residual"] is RESIDUAL  # this rank's own, as it was


def test_a_joining_rank_starts_at_zero_with_the_shared_counters():
    assert carried_across_resize(shared_part(STATE), {}) == {PIPELINE_KEY: {"step": 12}, STEPS_KEY: {"step": 14}}


def test_auto_carries_its_decision_and_each_candidates_counters():
    drained = np.ones(3, np.float32)
    state = {"auto": {"phase": "settled", "plan": {"0.weight": "topk:density=0.01"}, "trials": None,
                      "chosen": "topk", "steps": 40},
             "candidates": {"topk:density=0.01": STATE, "int4": {}},
             "drain": {"0.bias": drained}}
    shared = shared_part(state)
    assert shared == {"auto": state["auto"],
                      "candidates": {"topk:density=0.01": {PIPELINE_KEY: {"step": 12}, STEPS_KEY: {"step": 14}},
                                     "int4": {PIPELINE_KEY: {"step": 0}}}}
    carried = carried_across_resize(shared, own_part(state))
    assert carried["auto"] == state["auto"] and carried["drain"] == {"0.bias": drained}
    assert carried["candidates"]["topk:density=0.01"] == {"0.weight": {"memory_residual": RESIDUAL},
                                                          PIPELINE_KEY: {"step": 12}, STEPS_KEY: {"step": 14}}
    assert carried_across_resize(shared, {}) == shared  # a joining rank: nothing of its own


def test_the_report_says_what_was_lost():
    text = str(ElasticReport(size_before=3, size=2, departed=1, joined=0, step=12))
    assert "3 -> 2" in text and "residuals of 1 departed rank(s) are lost" in text and "from 12" in text
