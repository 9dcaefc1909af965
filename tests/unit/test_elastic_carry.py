"""What a compressor's state carries into a new world (horovod_sparse.torch.elastic): each
gradient's own per-element fields, by name, and the agreed step counters; the whole-buffer
state (the exchange's counters and world size, PowerSGD's Q's) starts afresh. The elastic jobs
themselves run in test_elastic_launch.py."""
import numpy as np

from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.torch.elastic import ElasticReport, carried_across_resize
from horovod_sparse.torch.out_of_band import STEPS_KEY


def test_a_survivor_keeps_its_gradients_fields_and_takes_the_agreed_counters():
    residual = np.arange(4, dtype=np.float32)
    state = {"0.weight": {"memory_residual": residual},
             PIPELINE_KEY: {"step": 12, "engine_world_size": 3, "engine_calls": 12, "q_0": np.ones((4, 2))},
             STEPS_KEY: {"step": 14}}
    carried = carried_across_resize(state, 30, 31)
    assert carried == {"0.weight": {"memory_residual": residual}, PIPELINE_KEY: {"step": 30}, STEPS_KEY: {"step": 31}}
    assert carried["0.weight"]["memory_residual"] is residual  # this rank's own, as it was


def test_a_joining_rank_starts_at_zero_with_the_agreed_counters():
    assert carried_across_resize({}, 30) == {PIPELINE_KEY: {"step": 30}}


def test_the_report_says_what_was_lost():
    text = str(ElasticReport(size_before=3, size=2, departed=1, joined=0, step=12))
    assert "3 -> 2" in text and "residuals of 1 departed rank(s) are lost" in text and "from 12" in text
