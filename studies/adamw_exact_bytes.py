"""How many bytes does a run under horovod_sparse.torch.AdamW send, against fp32 dense?

The byte transformer of docs/results/accuracy.md (stdlib_lm, 4 x 256, P = 2) under ``--spec``
(``onebit`` by default): one exact step and one compressed step with the exact steps sent each
way (``exact_compression`` none, fp16, int8, int6), their bytes as the compressor counts them
(``bytes_sent_per_step(P)``: what its exchanges sent, and a ring allreduce's share of what
Horovod carried: small gradients, probes, exact steps in fp32 or fp16). fp32 dense is Horovod's
ring allreduce of every gradient, 2 (P - 1) / P x 4 n bytes. Then, for each ``--schedules``
``EXACT_WARMUP,MAX_INTERVAL,STEPS``, the run's exact steps E (``ExactSteps.count``) and its bytes
against fp32 dense's: STEPS x dense / (E x exact + (STEPS - E) x compressed). Rank 0 prints a
table. Output kept in docs/results/data/accuracy/adamw-exact-bytes.txt:

    mpirun -np 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 python studies/adamw_exact_bytes.py
"""
import argparse

import horovod.torch as hvd

import horovod_sparse.torch as hvds
from horovod_sparse.exact_steps import EXACT_COMPRESSIONS, ExactSteps
from horovod_sparse.out_of_band import ring_bytes
from horovod_sparse.workloads import stdlib_lm

SIZE = dict(layers=4, d_model=256, heads=4)


def bytes_per_step(spec, exact_compression):
    """(bytes of an exact step, bytes of a compressed step) this rank sent, as the compressor counts them."""
    model = stdlib_lm.build_model(0, **SIZE)
    compression = hvds.Compression.from_spec(spec)
    # exact: step 0 (the warm-up), then 1 and 2 (intervals 1, 2); step 3 compressed
    opt = hvd.DistributedOptimizer(hvds.AdamW(model.parameters(), lr=1e-3, exact_warmup=1, max_interval=4,
                                              exact_compression=exact_compression),
                                   named_parameters=model.named_parameters(), compression=compression)
    batches = stdlib_lm.batches(hvd.rank(), hvd.size())
    sent = {}
    for step in range(4):
        opt.zero_grad()
        stdlib_lm.loss(model, next(batches)).backward()
        opt.step()
        _, exact = compression.exact_report
        sent.setdefault(exact, compression.bytes_sent_per_step(hvd.size()))
    compression.close()
    return sent[True], sent[False]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="onebit")
    parser.add_argument("--schedules", nargs="+", default=["100,32,1000", "200,10,1000", "200,8,1000", "100,32,2000",
                                                           "200,32,2000", "200,24,2000", "200,12,2000"])
    args = parser.parse_args()
    hvd.init()
    n = sum(p.numel() for p in stdlib_lm.build_model(0, **SIZE).parameters())
    dense = ring_bytes(4 * n, hvd.size())
    measured = {how: bytes_per_step(args.spec, how) for how in EXACT_COMPRESSIONS}
    if hvd.rank() != 0:
        return
    print(f"{args.spec}, stdlib_lm {SIZE}, {n:,} parameters, P = {hvd.size()}; bytes sent per step by one rank")
    print(f"fp32 dense (Horovod's ring allreduce): {dense:,}")
    for how, (exact, compressed) in measured.items():
        print(f"exact steps {how}: exact step {exact:,} ({exact / dense:.4f} of dense), "
              f"compressed step {compressed:,} ({compressed / dense:.4f})")
    print("\n| exact_warmup | max_interval | steps | exact steps | " +
          " | ".join(f"fewer bytes than fp32, exact {how}" for how in measured) + " |")
    print("|" + "---:|" * (4 + len(measured)))
    for schedule in args.schedules:
        warmup, interval, steps = map(int, schedule.split(","))
        count = ExactSteps(warmup, interval).count(steps)
        ratios = [steps * dense / (count * exact + (steps - count) * compressed)
                  for exact, compressed in measured.values()]
        print(f"| {warmup} | {interval} | {steps} | {count} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")


if __name__ == "__main__":
    main()
