"""scripts/recipe_study.py on constructed records: the seed table's gaps and spread, time to
target per link as steps to target x the step benchmark's median, and the direct check."""
import pytest

from scripts_under_test import load_script

study = load_script("recipe_study")


def tta(compressor, finals, seed=0, link="loopback", seconds_per_step=0.1):
    """A bench_tta record whose evaluations every 100 steps read ``finals`` (lower is better)."""
    curve = [{"step": 100 * (i + 1), "seconds": 100 * (i + 1) * seconds_per_step, "metric": m}
             for i, m in enumerate(finals)]
    return {"bench": "tta", "workload": "stdlib_lm", "metric": "bits_per_byte", "higher_is_better": False,
            "compressor": compressor, "seed": seed, "link": link, "np": 2, "params": 10, "tensors": 2,
            "batch": 4, "steps": 100 * len(finals), "seconds": curve[-1]["seconds"], "recipe": {"name": "adamw", "lr": 1e-3}, "curve": curve,
            "driver_command": f"bench_tta {compressor} {seed} {link}"}


def step(compressor, link, ms):
    return {"bench": "step", "compressor": compressor, "link": link, "total_ms": ms,
            "driver_command": f"bench_step {link}"}


STUDY = [tta("hvd-none", [3.0, 2.0, 1.00]), tta("hvd-none", [3.0, 2.0, 1.02], seed=1),
         tta("hvd-fp16", [3.0, 2.0, 1.005]), tta("topk:density=0.01", [3.0, 2.5, 1.05]),
         tta("qsgd:levels=127,error_feedback=true", [3.0, 1.01, 1.0]),
         tta("qsgd:levels=127,error_feedback=true", [3.0, 2.0, 1.03], seed=1)]
STEPS = [step("dense", "1gbit", 200.0), step("hvd-fp16", "1gbit", 150.0), step("topk:density=0.01", "1gbit", 100.0),
         step("qsgd:levels=127,error_feedback=true", "1gbit", 120.0), step("dense", "loopback", 90.0)]


def row(table, name):
    return next(line for line in table.splitlines() if line.startswith(f"| {name} "))


def test_seed_table_gives_the_mean_gap_at_the_same_seeds_and_dense_spread():
    table, spread = study.seeds_table(STUDY, tolerance=0.01)
    assert "| seed 0 | seed 1 |" in table
    assert "+5.00% (1 seed) | no |" in row(table, "`topk:density=0.01`")
    # seed 0: 0%, seed 1: (1.03 - 1.02) / 1.02 = +0.98%: mean +0.49%, within 1% at both
    assert "+0.49% (2 seeds) | yes |" in row(table, "`qsgd:levels=127,error_feedback=true`")
    assert "1.98%" in spread  # (1.02 - 1.00) / 1.01


def test_time_to_target_is_steps_to_target_times_the_links_step():
    target = study.target_of(STUDY, 0.01)
    assert target == pytest.approx(1.01)
    assert study.reach_steps(STUDY, target) == {"hvd-none": 300, "hvd-fp16": 300, "topk:density=0.01": None,
                                                "qsgd:levels=127,error_feedback=true": 200}
    table = study.derived_table(STUDY, STEPS, target)
    # qsgd: 200 steps x 120 ms = 24 s; dense 300 x 200 ms = 60 s (2.50x); fp16 300 x 150 ms = 45 s (1.88x)
    # columns: steps to target, then per link (loopback, 1gbit) step ms, seconds, vs dense, vs fp16
    assert row(table, "`qsgd:levels=127,error_feedback=true`").endswith("| 200 |  |  |  |  | 120 | 24.0 | 2.50x | 1.88x |")
    assert row(table, "`topk:density=0.01`").endswith("| never |  |  |  |  | 100 | never |  |  |")
    assert row(table, "Horovod dense (none)").endswith("| 300 | 90 | 27.0 | 1.00x |  | 200 | 60.0 | 1.00x | 0.75x |")


def test_direct_runs_are_set_beside_the_derivation_and_their_curves_compared():
    direct = [tta("hvd-none", [3.0, 2.0, 1.00], link="1gbit", seconds_per_step=0.25),
              tta("qsgd:levels=127,error_feedback=true", [3.0, 1.02, 1.0], link="1gbit", seconds_per_step=0.1)]
    table = study.direct_table(direct, STUDY, STEPS, tolerance=0.01)
    # dense: 300 steps measured in 75 s, derived 300 x 0.2 s = 60 s; same curve as loopback's
    assert row(table, "Horovod dense (none)").endswith("| 1gbit | 300 | 75.0 | 60.0 | 0.80 | yes |")
    # the quantizer's direct curve differs from its loopback one (1.01 there): said so
    assert row(table, "`qsgd:levels=127,error_feedback=true`").endswith("| 1gbit | 300 | 30.0 | 36.0 | 1.20 | no |")


def test_direct_runs_without_a_dense_run_on_their_link_use_the_studys_target():
    direct = [tta("topk:density=0.01", [3.0, 1.005, 1.0], link="10gbit", seconds_per_step=0.1)]
    # the study's target is 1.01 (dense's 1.00 within 1%): reached at step 200, after 20 s
    assert row(study.direct_table(direct, STUDY, STEPS, tolerance=0.01), "`topk:density=0.01`").startswith(
        "| `topk:density=0.01` | 10gbit | 200 | 20.0 |")


def test_the_block_names_its_target_and_commands(tmp_path):
    text = study.markdown(STUDY, STEPS, [], tolerance=0.01)
    assert "Target: 1.01" in text and "- `bench_step 1gbit`" in text and "- `bench_tta hvd-none 0 loopback`" in text
    assert study.markdown([r for r in STUDY if r["compressor"] != "hvd-none"], STEPS, [], 0.01).startswith("No Horovod")
    assert "it timed" not in text  # the step records carry no other model
    timed_elsewhere = [dict(r, model="digits_resnet") for r in STEPS]
    assert ("(it timed digits_resnet: the same model, input shape and batch on other data)"
            in study.markdown(STUDY, timed_elsewhere, [], tolerance=0.01))


def test_the_loss_replaces_a_saturated_metric():
    run = dict(tta("hvd-none", [3.0, 2.0]), metric="accuracy", higher_is_better=True)
    for point, loss in zip(run["curve"], (0.5, 0.1)):
        point["loss"] = loss
    (moved,) = study.on_loss([run])
    assert moved["metric"] == "validation loss" and moved["higher_is_better"] is False
    assert [p["metric"] for p in moved["curve"]] == [0.5, 0.1] and run["curve"][0]["metric"] == 3.0
