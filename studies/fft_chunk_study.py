#!/usr/bin/env python3
"""How much of a real gradient the FFT compressor keeps, per chunk size, against top-k.

For the gradients of a model trained on the demo's data (scikit-learn digits), at a
few points of training, this measures the fraction of the gradient's energy (squared
L2 norm) that survives the FFT compressor's drop, 1 - ||g - irfft(kept)||^2 / ||g||^2,
for several ``chunk_size`` values at one theta, next to time-domain top-k keeping the
same number of floats (each kept complex coefficient is two floats). No quantization,
no error feedback: the drop alone. Single process, no MPI.

    .venv/bin/python studies/fft_chunk_study.py
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from horovod_sparse.fft.selection import TopCoefficients
from horovod_sparse.fft.spectrum import ChunkedSpectrum, coefficient_positions


def gradients(hidden, steps, every, seed=0):
    """The fused weight gradients of a digits MLP (64-hidden-hidden-10) every ``every`` steps."""
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=generator)
        opt.zero_grad()
        F.cross_entropy(model(x[batch]), y[batch]).backward()
        if step % every == 0:
            out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.ndim > 1]).numpy().copy())
        opt.step()
    return out


def fft_kept_energy(g, chunk_size, theta):
    """The pipeline's own transform and selection (float32, exact top energies)."""
    spectrum = ChunkedSpectrum(g.size, chunk_size)
    s = spectrum.forward(g, np.empty(spectrum.size, np.float32))
    count = spectrum.n_coefficients
    keys = spectrum.energy_keys(s, np.empty(count, np.float32), np.empty(2 * count, np.float32))
    kept = TopCoefficients().select(keys, count - int(np.floor(theta * count)), np.empty(count, bool))
    positions = coefficient_positions(kept, np.empty(2 * kept.size, np.int64))
    sparse = np.zeros_like(s)
    sparse[positions] = s[positions]
    error = (g - spectrum.inverse(sparse, np.empty(g.size, np.float32))).astype(np.float64)
    return 1 - float(error @ error) / float(g.astype(np.float64) @ g), positions.size


def topk_kept_energy(g, floats):
    kept = np.argpartition(-np.abs(g), floats - 1)[:floats]
    return float(g[kept] @ g[kept]) / float(g @ g)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512, help="hidden width (weights: 64h + h^2 + 10h)")
    p.add_argument("--theta", type=float, default=0.9)
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384, 0],
                   help="chunk sizes; 0 = the whole buffer in one transform")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=60)
    a = p.parse_args()
    grads = gradients(a.hidden, a.steps, a.every)
    n = grads[0].size
    print(f"digits MLP 64-{a.hidden}-{a.hidden}-10, {n:,} weights, gradients at steps "
          f"{list(range(0, a.steps, a.every))}, theta = {a.theta} (fraction of coefficients dropped)\n")
    print("| chunk_size | floats kept | energy kept by FFT (mean) | by top-k, same floats (mean) |")
    print("|---:|---:|---:|---:|")
    for chunk in a.chunks:
        size = chunk or n
        results = [fft_kept_energy(g, size, a.theta) for g in grads]
        floats = results[0][1]
        fft = np.mean([r[0] for r in results])
        topk = np.mean([topk_kept_energy(g, floats) for g in grads])
        print(f"| {'whole buffer' if chunk == 0 else chunk} | {floats:,} ({floats / n:.1%}) | {fft:.3f} | {topk:.3f} |")


if __name__ == "__main__":
    main()
