#!/usr/bin/env python3
"""Record the top-k selections of real training, rank by rank, for the exchange benchmark.

One process (no MPI) plays P data-parallel ranks: it builds a workload's model, trains it
densely on the workload's own data (each step's update uses the mean of the P ranks'
gradients on their shards, exactly as P-rank data parallelism would), and at the recorded
steps keeps, for every simulated rank r, the top-k entries by magnitude (k = density * n) of
rank r's own gradient, fused over all parameters in ``model.parameters()`` order. The
selections of different ranks then overlap the way real ones do (the ranks share the large
coordinates), unlike the uniform random indices of ``bench_exchange.py`` by default.

Output: one compressed ``.npz`` with ``indices`` (int32, ``(steps, P, k)``, sorted within
each row), ``values`` (float32, the same shape), ``steps`` (the recorded step numbers),
``n``, ``k``, ``density``, ``P``, and ``meta`` (a JSON string: workload, size, optimizer,
command, date). ``bench_exchange.py --selections FILE --step S`` gives rank r the selection
of simulated rank r at recorded step S. With ``--out FILE.json`` only the overlap is kept: per
recorded step, the union of the first P ranks' selections for P = 2, 4, ... (what
``predict_scale.py --unions`` reads), a few hundred bytes instead of the selections.

    python scripts/record_selections.py --workload stdlib_lm --size layers=2,d_model=256,heads=4 \\
        --ranks 32 --steps 21 --record 0,10,20 --out docs/results/data/oktopk-scale/selections.npz
"""
import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from horovod_sparse.whatif.exchange_cost import selection_unions  # noqa: E402  (no framework at import)
from horovod_sparse.workloads import parse_size  # noqa: E402  (stdlib only at import)


def fused_gradient(model):
    import torch
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def top_k(flat, k):
    """(sorted int32 indices, float32 values) of the k largest |flat|."""
    import torch
    chosen = torch.topk(flat.abs(), k, sorted=False).indices
    chosen = torch.sort(chosen).values
    return chosen.numpy().astype(np.int32), flat[chosen].numpy().astype(np.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="stdlib_lm", help="stdlib_lm or digits_resnet")
    p.add_argument("--size", type=parse_size, default="layers=2,d_model=256,heads=4",
                   help="model size for stdlib_lm's build_model (default: %(default)s)")
    p.add_argument("--ranks", type=int, default=32, help="simulated ranks P")
    p.add_argument("--batch", type=int, default=None, help="examples per rank (workload's BATCH)")
    p.add_argument("--steps", type=int, default=21, help="training steps")
    p.add_argument("--record", default="0,10,20", help="steps whose selections are kept")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    from horovod_sparse import workloads
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    w = workloads.get(args.workload)
    size = args.size if args.workload == "stdlib_lm" else {}
    model = w.build_model(seed=args.seed, **size)
    model.train()
    params = list(model.parameters())
    n = int(sum(q.numel() for q in params))
    k = max(1, int(round(args.density * n)))
    record = sorted({int(s) for s in args.record.split(",") if s.strip()})
    if any(s >= args.steps or s < 0 for s in record):
        p.error("--record steps must lie in [0, --steps)")
    batch = args.batch or w.BATCH
    streams = [w.batches(r, args.ranks, batch=batch, seed=args.seed) for r in range(args.ranks)]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    print(f"[record] {args.workload} {size} n={n:,} k={k:,} P={args.ranks} batch {batch}/rank, "
          f"steps {args.steps}, recording {record}", flush=True)

    indices = np.empty((len(record), args.ranks, k), np.int32)
    values = np.empty((len(record), args.ranks, k), np.float32)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        shards = [next(s) for s in streams]
        optimizer.zero_grad(set_to_none=True)
        if step in record:  # each rank's own gradient, then their mean for the update
            row = record.index(step)
            total = torch.zeros(n)
            loss_sum = 0.0
            for r, shard in enumerate(shards):
                for q in params:
                    q.grad = None
                loss = w.loss(model, shard)
                loss.backward()
                flat = fused_gradient(model)
                indices[row, r], values[row, r] = top_k(flat, k)
                total += flat
                loss_sum += loss.item()
            mean = total / args.ranks
            offset = 0
            for q in params:
                q.grad = mean[offset:offset + q.numel()].view_as(q).clone()
                offset += q.numel()
            losses.append(loss_sum / args.ranks)
        else:  # one pass over the global batch: the same mean gradient
            joined = tuple(torch.cat(parts) for parts in zip(*shards))
            loss = w.loss(model, joined)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        print(f"[record] step {step} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    meta = {
        "workload": args.workload, "size": size, "n": n, "k": k, "density": args.density,
        "P": args.ranks, "batch_per_rank": batch, "steps": args.steps, "recorded_steps": record,
        "optimizer": f"AdamW lr={args.lr}", "seed": args.seed, "losses": [round(x, 4) for x in losses],
        "order": "model.parameters() order, each flattened (row-major)",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.relpath(sys.argv[0], _REPO)] + (argv or sys.argv[1:])),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.out.endswith(".json"):
        with open(args.out, "w") as f:
            json.dump({**meta, "unions": {str(s): selection_unions(indices[i]) for i, s in enumerate(record)}},
                      f, indent=1)
        print(f"[record] wrote {args.out} (the unions of the selections)", flush=True)
        return 0
    np.savez_compressed(args.out, indices=indices, values=values, steps=np.array(record, np.int64),
                        n=np.int64(n), k=np.int64(k), density=np.float64(args.density),
                        P=np.int64(args.ranks), meta=np.array(json.dumps(meta)))
    print(f"[record] wrote {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
