"""``Compression.auto`` under a loss scaler's overflow, without ranks: the quality guard ignores a
ratio that is not finite, and a skipped step gives back what it took (the runtime's books, as
both frontends keep them; the parallel tests run them through Horovod)."""
import math

import numpy as np
import pytest

from horovod_sparse.auto.decide import guard_violations
from horovod_sparse.auto.runtime import AutoRuntime

CANDIDATES = ("fp16", "topk:density=0.05")


def test_the_guard_ignores_ratios_that_are_not_finite():
    ratios = {"a": math.inf, "b": math.nan, "c": -math.inf, "d": 31.0, "e": 3.0}
    assert guard_violations(ratios, 30.0) == ["d"]
    assert guard_violations({"a": math.inf}, 30.0) == []


def test_nonfinite_is_checked_and_is_one_of_the_settings():
    with pytest.raises(ValueError, match="nonfinite"):
        AutoRuntime(candidates=CANDIDATES, nonfinite="skip")
    assert AutoRuntime(candidates=CANDIDATES).nonfinite == "propagate"
    raising = AutoRuntime(candidates=CANDIDATES, nonfinite="raise")
    assert "nonfinite=raise" in raising.settings()  # ranks that would act differently fail together
    assert raising.report["skipped_steps"] == 0


def test_a_skipped_step_gives_back_its_residuals_and_new_keys_and_is_not_timed():
    runtime = AutoRuntime(candidates=CANDIDATES, dense_below=10)
    runtime.plan = {"w": "fp16"}
    runtime.phase = "settled"
    residual = np.arange(4, dtype=np.float32)
    runtime.drain = {"w": residual, "v": residual + 1}
    runtime.start_step(now=10.0)
    assert runtime.choice_for("w", 100) == "fp16"
    assert runtime.choice_for("new", 100) == "topk:density=0.05"
    assert runtime.drained("w") is residual and runtime.drained("v") is not None
    runtime.skip_step(keep={"v"})  # v's exchange took its residual in before the overflow was known
    assert runtime.plan == {"w": "fp16"}
    assert list(runtime.drain) == ["w"] and runtime.drain["w"] is residual
    assert runtime.report["skipped_steps"] == 1 and runtime.steps == 0
    runtime.start_step(now=12.5)  # the skipped step's period (2.5 s) is recorded for nothing
    assert runtime._periods == []
    runtime.start_step(now=13.0)  # the next one's is
    assert runtime._periods == [0.5]


def test_a_skipped_step_leaves_the_profile_as_it_was():
    runtime = AutoRuntime(candidates=CANDIDATES, dense_below=10)
    runtime.start_step(now=1.0)
    runtime.trace.arrived("w", at=1.1)
    runtime.trace.end_step(at=1.2)
    runtime.start_step(now=2.0)
    runtime.trace.arrived("w", at=2.1)
    runtime.skip_step()
    assert len(runtime.trace.steps) == 1 and runtime.trace._current == []
