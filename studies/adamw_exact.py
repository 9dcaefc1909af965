"""Does horovod_sparse.torch.AdamW (v from exact steps only) keep top-k's AdamW run nearer dense?

One short look, not the study: the byte transformer of docs/results/accuracy.md (stdlib_lm,
4 x 256, P = 2, the workload's batch, AdamW lr 1e-3 wd 0.01 with a 10% linear warm-up and
cosine decay, seed 0), trained ``--steps`` steps three ways from the same model and batches:
Horovod dense with torch's AdamW, top-k 0.01 with torch's AdamW, top-k 0.01 with this AdamW.
Both top-k runs warm up ``--warmup`` dense steps (the compressor's ``warmup_steps``, and this
AdamW's ``exact_warmup``); ``--max-interval`` is the schedule's cap. Rank 0 prints one line per
run: validation bits per byte at the end, the exact steps, the bytes against fp32 dense's
(exact steps at a ring allreduce's 2(P-1)/P fp32 gradients, the others what the compressor
counted). Output kept in docs/results/data/accuracy/adamw-exact-200.txt:

    mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 python studies/adamw_exact.py --steps 200
    mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 python studies/adamw_exact.py --steps 200 \
        --max-interval 8 --runs adamw-exact
"""
import argparse
import time

import horovod.torch as hvd
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.workloads import stdlib_lm
from horovod_sparse.workloads.recipes import RECIPES

SIZE = dict(layers=4, d_model=256, heads=4)


def train(name, steps, warmup, max_interval):
    model = stdlib_lm.build_model(seed=0, **SIZE)
    recipe = RECIPES["adamw"]
    if name == "dense":
        opt, compression = recipe.optimizer(model.parameters()), hvd.Compression.none
    else:
        compression = hvds.Compression.topk(density=0.01, warmup_steps=warmup)
        opt = recipe.optimizer(model.parameters()) if name == "topk" else \
            hvds.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay,
                       exact_warmup=warmup, max_interval=max_interval)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    schedule = recipe.schedule(opt, steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = stdlib_lm.batches(hvd.rank(), hvd.size())
    exact, sent, start = 0, 0.0, time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        stdlib_lm.loss(model, next(data)).backward()
        opt.step()
        schedule.step()
        report = getattr(compression, "exact_report", None)
        exact += 1 if report is None or report[1] else 0
        if hasattr(compression, "bytes_sent_per_step"):
            sent += compression.bytes_sent_per_step(hvd.size()) if report is None or not report[1] else 0
    n = sum(p.numel() for p in model.parameters())
    dense = 2 * (hvd.size() - 1) / hvd.size() * 4 * n      # a ring allreduce of fp32, per step
    total = exact * dense + sent
    return stdlib_lm.evaluate(model)["bits_per_byte"], exact, steps * dense / total, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-interval", type=int, default=32)
    p.add_argument("--runs", nargs="+", default=["dense", "topk", "adamw-exact"])
    a = p.parse_args()
    hvd.init()
    for name in a.runs:
        bpb, exact, fewer, seconds = train(name, a.steps, a.warmup, a.max_interval)
        if hvd.rank() == 0:
            print(f"{name:12s} {a.steps} steps: {bpb:.4f} bits/byte, {exact} exact steps, "
                  f"{fewer:.1f}x fewer bytes than fp32 dense, {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
