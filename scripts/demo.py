#!/usr/bin/env python3
"""The main job: data-parallel training of a small classifier on several MPI ranks,
once dense and once per compressor, printing accuracy, bytes and step time side by side.

Launch (what `make demo` does):
    horovodrun -np 4 -H localhost:4 python scripts/demo.py

Data: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes; no
download), split 80/20 with a fixed seed. Each rank trains on its own shard of the
training set; the model is a 64-128-10 MLP trained with SGD + momentum through the
stock ``hvd.DistributedOptimizer``.
"""
import argparse
import statistics
import sys
import time

import horovod
import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse.out_of_band import ring_bytes

DEFAULT_RUNS = ["dense", "none", "fp16", "randomk:density=0.1", "randomk:density=0.01",
                "topk:density=0.01", "topk:density=0.01,error_feedback=false", "oktopk:density=0.01",
                "gtopk:density=0.01", "gaussiank:density=0.01", "threshold:value=0.002", "dgc:density=0.01",
                "bf16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit", "powersgd", "fft"]
#: plain SGD (no optimizer momentum) for the compressors that apply momentum themselves (DGC's
#: momentum correction, Signum) and for signSGD, which is by definition SGD on the gradient's sign
OWN_MOMENTUM = ("dgc", "signum", "signsgd")
#: the sign methods move every coordinate by the learning rate at each step: they need a far smaller
#: one (their papers use 1e-3 .. 1e-4 with Adam-like scales)
LEARNING_RATE = {"signsgd": 0.002, "signum": 0.002}


def load_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.2, random_state=0,
                                                        stratify=digits.target)
    shard = slice(hvd.rank(), None, hvd.size())  # this rank's part of the training set
    return (torch.from_numpy(x_train[shard]), torch.from_numpy(y_train[shard]),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def compression_for(run):
    """``dense`` is Horovod's own Compression.none; anything else is a horovod_sparse spec."""
    return hvd.Compression.none if run == "dense" else hvds.Compression.from_spec(run)


def train_one(run, data, epochs, batch_size, lr, momentum):
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    compression = compression_for(run)
    name = run.split(":")[0]
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE.get(name, lr),
                          momentum=0.0 if name in OWN_MOMENTUM else momentum)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    generator = torch.Generator().manual_seed(hvd.rank())
    # Every rank must take the same number of steps: use the smallest shard's count.
    steps_per_epoch = int(hvd.allreduce(torch.tensor(len(x_train) // batch_size), op=hvd.Min, name="steps"))
    step_times = []
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * batch_size:(step + 1) * batch_size]
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            opt.step()
            step_times.append(time.perf_counter() - start)

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(params[None], name=f"replicas.{run}")
    identical = bool((gathered == gathered[0]).all())
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = compression.bytes_sent_per_step(hvd.size()) if hasattr(compression, "bytes_sent_per_step") \
        else ring_bytes(dense_bytes, hvd.size())
    median_ms = 1000 * float(hvd.allreduce(torch.tensor(statistics.median(step_times)), op=hvd.Max,
                                           name=f"time.{run}"))
    return dict(run=run, accuracy=accuracy, sent=sent, dense=ring_bytes(dense_bytes, hvd.size()), median_ms=median_ms,
                identical=identical, steps=len(step_times))


def say(text):
    """Print whole lines in one write: horovodrun tags each chunk of a rank's output
    (``[1,0]<stdout>:``), so a line written in pieces gets a tag in its middle."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_table(rows, size, epochs):
    """A plain ASCII table, one print per line: horovodrun prefixes every chunk of a rank's output
    with a tag such as ``[1,0]<stdout>:``, and it cuts wide lines and multi-byte box characters."""
    say(f"digits MLP, {size} ranks, {epochs} epochs, {rows[0]['steps']} steps "
        f"(Horovod {horovod.__version__}, MPI, CPU)")
    header = ["compression", "test acc", "sent B/rank/step", "vs dense", "step ms", "identical"]
    lines = [[r["run"], f"{r['accuracy']:.4f}", f"{r['sent']:,.0f}", f"{r['dense'] / max(r['sent'], 1):.1f}x",
              f"{r['median_ms']:.2f}", "yes" if r["identical"] else "NO"] for r in rows]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    for cells in [header, ["-" * w for w in widths], *lines]:
        say("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))))
    say("sent: bytes this rank sends per step (last step). What Horovod's allreduce carries is counted\n"
        "as a ring allreduce sends it, 2(P-1)/P x payload; the sparse exchanges' bytes are counted on\n"
        "the wire, control messages included. Dense: a ring allreduce of all gradients. top-k, Ok-Topk\n"
        "and PowerSGD send their first 100 steps dense, on Horovod's allreduce (their warm-up:\n"
        "horovod_sparse.warmup).")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS,
                        help="'dense' (Horovod's Compression.none) or horovod_sparse specs")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (DGC, signSGD and Signum runs use 0)")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    data = load_data()
    rows = []
    for run in args.runs:
        rows.append(train_one(run, data, args.epochs, args.batch_size, args.lr, args.momentum))
        if hvd.rank() == 0:
            say(f"  {run}: test accuracy {rows[-1]['accuracy']:.4f}")
    if hvd.rank() == 0:
        print_table(rows, hvd.size(), args.epochs)
    if not all(r["identical"] for r in rows):
        raise SystemExit("error: replicas diverged")


if __name__ == "__main__":
    main()
