#!/usr/bin/env python3
"""Which of the package's files one steady training step runs through, and in what order.

Trains a small model with ``hvd.DistributedOptimizer(compression=...)`` for a few steps
(the layout agreed, the pipeline made), then records, with ``sys.setprofile`` on every
thread, each function of ``horovod_sparse`` called during one more step. Prints the files
in the order the step first enters them, with the functions called in each: the path of a
gradient from ``compress`` to the wire and back (docs/architecture.md).

    mpirun -np 2 .venv/bin/python scripts/step_files.py --compressor topk:density=0.01

PyTorch only: TensorFlow runs a step's exchanges inside ``tf.numpy_function`` on its own
threads, which Python 3.11's profiler hooks do not reach.
"""
import argparse
import os
import sys
import threading
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "horovod_sparse"


class Recorder:
    """Files and functions of horovod_sparse entered while recording, in first-call order."""

    def __init__(self):
        self.files = {}  # relative path -> [function names, first-call order]

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(str(PACKAGE)):
            functions = self.files.setdefault(os.path.relpath(path, PACKAGE.parent), [])
            if frame.f_code.co_name not in functions:
                functions.append(frame.f_code.co_name)

    def __enter__(self):
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def torch_steps(spec, steps):
    import horovod.torch as hvd
    import torch
    import horovod_sparse.torch as hvds

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=hvds.Compression.from_spec(spec))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step, steps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressor", default="topk:density=0.01", help="a spec, e.g. topk:density=0.01")
    p.add_argument("--warmup", type=int, default=3, help="steps before the recorded one (default 3)")
    a = p.parse_args()
    step, _ = torch_steps(a.compressor, a.warmup)
    for _ in range(a.warmup):
        step()
    with Recorder() as recorder:
        step()
    if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
        print(f"{len(recorder.files)} files in one steady PyTorch step of {a.compressor}:")
        for i, (path, functions) in enumerate(recorder.files.items(), 1):
            print(f"{i:3d}. {path}: {', '.join(functions)}")


if __name__ == "__main__":
    main()
