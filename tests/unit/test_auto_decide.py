"""``Compression.auto``'s decision logic (horovod_sparse.auto.decide) on recorded profiles:
the prediction against a hand count, gradients hidden behind backward stay dense, a slower
link moves the choice toward compression, and the quality guard refuses what breaks it."""
import pytest

from horovod_sparse.auto.decide import (FP16, NONE, Costs, StepProfile, check_candidates, guard_violations,
                                        hidden_behind_backward, make_plans, predict, shortlist)
from horovod_sparse.schedule.cost import CostModel

TOPK = "topk:density=0.01"
# A recorded backward: the last layer's small gradients first, the big early layers last
# (seconds of backward before each gradient, as ArrivalTrace measures them).
PROFILE = StepProfile(order=("fc3.bias", "fc3.weight", "fc2.weight", "fc1.weight", "embed.weight"),
                      sizes=(512, 1 << 18, 1 << 20, 1 << 22, 1 << 23),
                      compute=(0.0, 0.002, 0.010, 0.030, 0.060),
                      tail_s=0.005)


def link(gbps, latency_s=50e-6):
    """A ring allreduce at P = 2 over ``gbps``: latency + 2 * (P-1)/P * bytes / bandwidth."""
    return CostModel(latency_s, 8 / (gbps * 1e9))


def costs(gbps, topk_per_byte=2e-10):
    # top-k's fused exchange: a fixed start-up and a codec running at memory speed (its wire
    # bytes are 1% of the input, so the link barely shows)
    return Costs(dense=link(gbps), candidates={TOPK: CostModel(2e-3, topk_per_byte + 0.02 * 8 / (gbps * 1e9))})


def test_predict_counts_horovods_allreduces_as_they_come_then_the_fused_exchange():
    plan = {"fc3.bias": NONE, "fc3.weight": FP16, "fc2.weight": TOPK, "fc1.weight": TOPK, "embed.weight": NONE}
    c = costs(10)
    ready = [0.0, 0.002, 0.012, 0.042, 0.102]
    end = c.dense(4 * 512)                                  # fc3.bias, at 0
    end = max(end, ready[1]) + c.dense(2 * (1 << 18))      # fc3.weight in fp16
    end = max(end, ready[4]) + c.dense(4 * (1 << 23))      # embed.weight, fp32
    end = max(end, 0.102 + 0.005)                           # backward's end
    end += c.candidates[TOPK](4 * ((1 << 20) + (1 << 22)))  # then top-k's one exchange
    assert predict(plan, PROFILE, c) == pytest.approx(end)


def test_gradients_whose_allreduce_hides_behind_backward_stay_dense():
    c = costs(10)
    hidden = hidden_behind_backward(PROFILE, c, NONE)
    # fc3's and fc2's allreduces (1 MB, 4 MB: under 4 ms at 10 Gbit/s) end long before backward does;
    # embed.weight arrives last: nothing after it can hide
    assert {"fc3.bias", "fc3.weight", "fc2.weight"} <= hidden and "embed.weight" not in hidden
    plans = make_plans(PROFILE, c, [FP16, TOPK], dense_below=1024)
    mix = plans[f"{TOPK}, none where hidden"]
    assert all(mix[k] == NONE for k in hidden) and mix["embed.weight"] == TOPK
    # hiding them costs nothing: the mix is predicted no slower than top-k everywhere
    assert predict(mix, PROFILE, c) <= predict(plans[TOPK], PROFILE, c)
    # and a hidden gradient costs the mix nothing on top of backward
    assert predict({**mix, "embed.weight": TOPK}, PROFILE, c) == pytest.approx(
        PROFILE.backward_end + c.candidates[TOPK](4 * sum(n for k, n in zip(PROFILE.order, PROFILE.sizes)
                                                          if mix[k] == TOPK)))


def test_a_slower_link_moves_the_choice_toward_stronger_compression():
    def compressed_elements(gbps):
        best = shortlist(make_plans(PROFILE, costs(gbps), [FP16, TOPK], 1024), PROFILE, costs(gbps))[0][1]
        return sum(n for k, n in zip(PROFILE.order, PROFILE.sizes) if best[k] == TOPK), best

    fast, fast_plan = compressed_elements(400)     # NVLink-class: dense is nearly free
    slow, slow_plan = compressed_elements(1)       # 1 Gbit/s
    assert slow > fast
    assert slow_plan["embed.weight"] == TOPK
    assert all(choice in (NONE, FP16) for choice in fast_plan.values())


def test_the_shortlist_is_distinct_pruned_and_fastest_first():
    c = costs(1)
    plans = make_plans(PROFILE, c, [FP16, TOPK], 1024)
    short = shortlist(plans, PROFILE, c, prune=1.5, max_trials=3)
    seconds = [s for _, _, s in short]
    assert seconds == sorted(seconds) and seconds[-1] <= 1.5 * seconds[0] and len(short) <= 3
    assert len({tuple(sorted(p.items())) for _, p, _ in short}) == len(short)
    # at 1 Gbit/s dense fp32 is predicted far slower than the best: pruned
    assert NONE not in [name for name, _, _ in short]
    # top-k alone (the fixed compressor) is tried even where mixes are predicted faster
    assert TOPK in [name for name, _, _ in short]
    assert predict(plans[TOPK], PROFILE, c) > min(seconds)
    everything = shortlist(plans, PROFILE, c, prune=1e9, max_trials=100)
    assert NONE in [name for name, _, _ in everything]
    assert all(p["fc3.bias"] in (NONE, FP16) for _, p, _ in everything), "under dense_below: never compressed"


@pytest.mark.parametrize("candidates, words", [
    (["topk:density=0.001"], "min_density"),
    (["topk:density=0.05,error_feedback=false"], "error feedback"),
    (["qsgd"], "error feedback"),                      # unbiased, but no residual: refused
    (["randomk:density=0.1"], "Horovod's allreduce"),  # in-band
    (["powersgd:rank=1"], "min_rank"),
    (["fp16", "fp16"], "distinct"),
    ("topk", "list"),
    ([], "list"),
    (["nope"], "nope"),
])
def test_the_guard_refuses_candidates_that_break_it(candidates, words):
    with pytest.raises(ValueError, match="candidates|nope") as e:
        check_candidates(candidates, min_density=0.01, min_rank=2)
    assert words in str(e.value)


def test_the_guard_takes_the_defaults_and_flags_outgrown_residuals():
    assert check_candidates(["fp16", " topk:density=0.01", "powersgd:rank=2", "none"], 0.01, 1) == \
        ["fp16", "topk:density=0.01", "powersgd:rank=2", "none"]
    assert guard_violations({"a": 3.0, "b": 250.0, 7: 101.0}, 100.0) == [7, "b"]
    assert guard_violations({"a": 3.0}, 100.0) == []


def test_without_overlap_nothing_hides_and_every_allreduce_waits_for_backward():
    """On a CPU backward and Horovod's thread share the cores: the profile says so (overlap
    False), and the prediction starts every exchange at backward's end, as whatif does."""
    from dataclasses import replace
    cpu, c = replace(PROFILE, overlap=False), costs(10)
    assert hidden_behind_backward(cpu, c, NONE) == set()
    dense = {k: NONE for k in PROFILE.order}
    total = sum(c.dense(4 * n) for n in PROFILE.sizes)
    assert predict(dense, cpu, c) == pytest.approx(PROFILE.backward_end + total)
    assert predict(dense, PROFILE, c) < predict(dense, cpu, c)
    plans = make_plans(cpu, c, [FP16, TOPK], dense_below=1024)
    assert not [name for name in plans if "hidden" in name]


def test_the_quality_guard_covers_adam_and_momentum_and_keeps_the_8_bit_quantizer():
    import torch
    from horovod_sparse.auto.runtime import guarded_optimizer, keeps_recipe_quality
    p = [torch.zeros(1, requires_grad=True)]

    class MyAdam(torch.optim.AdamW):   # found by a base class's name
        pass

    assert guarded_optimizer(MyAdam(p)) == ("AdamW", "adaptive")
    assert guarded_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == ("SGD", "momentum")
    assert guarded_optimizer(torch.optim.SGD(p, lr=0.1)) == ("SGD", None)
    mixed = torch.optim.SGD([{"params": p}, {"params": [torch.zeros(1, requires_grad=True)], "momentum": 0.5}], lr=0.1)
    assert guarded_optimizer(mixed) == ("SGD", "momentum")   # any group with momentum
    assert [keeps_recipe_quality(s) for s in ("none", "fp16", "qsgd:levels=127,error_feedback=true", "qsgd:levels=127",
                                              "qsgd:levels=16,error_feedback=true", "topk:density=0.01", "powersgd",
                                              "int4", "int4:bucket_size=64", "int4:bits=3", "int4:bucket_size=512",
                                              "int4:error_feedback=false")] \
        == [True, True, True, False, False, False, False, True, True, False, False, False]  # int4 as measured
    from horovod_sparse.auto.decide import DEFAULT_CANDIDATES
    assert "int4" in DEFAULT_CANDIDATES


def test_guard_momentum_false_keeps_every_candidate_under_momentum_sgd_only():
    """``guard_momentum=False``: under SGD with momentum auto keeps every candidate and says so;
    under Adam's family the guard still holds; anything but a bool fails at construction."""
    import torch
    from horovod_sparse.auto.runtime import AutoRuntime
    p = [torch.zeros(1, requires_grad=True)]
    candidates = ("fp16", "topk:density=0.01", "powersgd:rank=2", "qsgd:levels=127,error_feedback=true")
    momentum, adamw = torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.AdamW(p)

    unguarded = AutoRuntime(candidates=candidates, guard_momentum=False)
    unguarded.guard_optimizer(momentum)
    assert list(unguarded.allowed) == list(candidates)
    assert unguarded.report["optimizer_guard"]["kind"] == "momentum"
    assert unguarded.report["optimizer_guard"]["kept"] == list(candidates)
    assert "guard_momentum=False" in unguarded.report["optimizer_guard"]["why"]

    guarded = AutoRuntime(candidates=candidates)
    guarded.guard_optimizer(momentum)
    assert list(guarded.allowed) == ["fp16", "qsgd:levels=127,error_feedback=true"]

    still = AutoRuntime(candidates=candidates, guard_momentum=False)
    still.guard_optimizer(adamw)
    assert list(still.allowed) == ["fp16", "qsgd:levels=127,error_feedback=true"]
    assert still.report["optimizer_guard"]["kind"] == "adaptive"
    assert "guard_momentum=True" in guarded.settings() and "guard_momentum=False" in still.settings()

    with pytest.raises(ValueError, match="guard_momentum must be True or False"):
        AutoRuntime(guard_momentum="false")
