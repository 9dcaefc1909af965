"""The training recipes users run (horovod_sparse.workloads.recipes: AdamW, and SGD with
momentum, each with linear warm-up and cosine decay) train the language model under Horovod
with top-k and PowerSGD at their warm-up (and, under AdamW, int4 and onebit under the
exact-step AdamW): the compressed run's validation loss ends within a stated margin of dense's
after the same steps, and every rank ends with bitwise-identical parameters.

Short on purpose: the workload's ``ByteTransformer`` at 2 layers x d_model 128 for 60 steps,
batch 4 per rank, warm-up 10 steps. The margins are measured, not guessed (the 2-core checkout
VM, validation loss in nats per byte after 60 steps, compressed minus dense, at P = 2, 3 and 4;
PowerSGD at its default rank 2, 2026-11-27, the rest 2026-11-26 and again then):

- AdamW: dense 3.047, 3.029, 3.018; top-k 0.01 +0.074, +0.067, +0.066; PowerSGD +0.017, +0.021,
  +0.023; without the warm-up (P = 2, 2026-11-26) top-k +0.51.
- momentum SGD: dense 2.842, 2.822, 2.825; top-k +0.040, +0.035, +0.033; PowerSGD +0.038,
  +0.041, +0.038; without the warm-up top-k +0.065.

A margin is the worst gap with the warm-up, plus a third: top-k without it fails both (under
AdamW by 5x). The long runs behind the numbers users see are in docs/results/accuracy.md.
"""
import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.workloads import recipes, stdlib_lm

# the margins hold at P = 2, 3 and 4 alike (above): the recipe's convergence, not the exchange
pytestmark = pytest.mark.world_sizes(2)

STEPS, BATCH, WARMUP = 60, 4, 10
SIZE = dict(layers=2, d_model=128, heads=4)
#: nats per byte a compressed run may end above dense, per recipe (module docstring)
MARGIN = {"adamw": 0.1, "momentum": 0.055}
COMPRESSIONS = {"dense": lambda: hvd.Compression.none,
                "topk": lambda: hvds.Compression.topk(density=0.01, warmup_steps=WARMUP),
                "powersgd": lambda: hvds.Compression.powersgd(warmup_steps=WARMUP)}


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def train(recipe_name, compression, make_optimizer=None):
    """Validation loss after STEPS steps of the recipe (its optimizer, or ``make_optimizer``'s
    over the parameters); the model."""
    recipe = recipes.recipe_for(stdlib_lm, recipe_name)
    model = stdlib_lm.build_model(seed=0, **SIZE)
    opt = (make_optimizer or recipe.optimizer)(model.parameters())
    schedule = recipe.schedule(opt, STEPS)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    batches = stdlib_lm.batches(hvd.rank(), hvd.size(), BATCH)
    for _ in range(STEPS):
        opt.zero_grad()
        stdlib_lm.loss(model, next(batches)).backward()
        opt.step()
        schedule.step()
    getattr(compression, "close", lambda: None)()
    return stdlib_lm.evaluate(model, count=32)["loss"], model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", sorted(MARGIN))
def test_compressed_runs_end_within_the_measured_margin_of_dense(recipe, assert_identical_across_ranks,
                                                                 record_property):
    dense, _ = train(recipe, COMPRESSIONS["dense"]())
    gaps = {}
    for name in ("topk", "powersgd"):
        loss, model = train(recipe, COMPRESSIONS[name]())
        assert_identical_across_ranks(flat_parameters(model))
        gaps[name] = loss - dense
    record_property("gaps", f"dense {dense:.4f}; " + ", ".join(f"{k} {v:+.4f}" for k, v in gaps.items()))
    assert all(gap < MARGIN[recipe] for gap in gaps.values()), (recipe, dense, gaps)


#: the exact-step AdamW at a schedule 60 steps can show: 10 exact steps, then at most 8 apart
EXACT_ADAMW = dict(exact_warmup=10, max_interval=8)
#: nats per byte above dense AdamW after STEPS steps; measured at P = 2 (2026-12-06, the 2-core
#: checkout VM): dense 3.047; int4 +0.002; onebit under the exact-step AdamW +0.033, under
#: torch's +0.082. The worst gap plus a third, as MARGIN's
ADAMW_CODEC_MARGIN = 0.045


def exact_step_adamw(params):
    """horovod_sparse.torch.AdamW at the adamw recipe's rates and EXACT_ADAMW's schedule."""
    recipe = recipes.recipe_for(stdlib_lm, "adamw")
    return hvds.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay, **EXACT_ADAMW)


@pytest.mark.timeout(300)
def test_int4_and_onebit_under_the_exact_step_adamw_end_near_dense(assert_identical_across_ranks, record_property):
    """int4 under torch's AdamW, and onebit under horovod_sparse.torch.AdamW, end within
    ADAMW_CODEC_MARGIN of dense AdamW; onebit under torch's AdamW (the failure the optimizer is
    for) ends further off than under ours."""
    dense, _ = train("adamw", hvd.Compression.none)
    runs = {"int4": (hvds.Compression.int4(), None),
            "onebit, exact-step AdamW": (hvds.Compression.onebit(), exact_step_adamw),
            "onebit, torch's AdamW": (hvds.Compression.onebit(), None)}
    gaps = {}
    for name, (compression, make_optimizer) in runs.items():
        loss, model = train("adamw", compression, make_optimizer)
        assert_identical_across_ranks(flat_parameters(model))
        gaps[name] = loss - dense
    record_property("gaps", f"dense {dense:.4f}; " + ", ".join(f"{k} {v:+.4f}" for k, v in gaps.items()))
    assert gaps["int4"] < ADAMW_CODEC_MARGIN and gaps["onebit, exact-step AdamW"] < ADAMW_CODEC_MARGIN, (dense, gaps)
    assert gaps["onebit, torch's AdamW"] > gaps["onebit, exact-step AdamW"], (dense, gaps)
