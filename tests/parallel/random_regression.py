"""The training loop the transport tests share: a regression on this rank's own random data."""
import torch


def fit_random_regression(model, opt, inputs, outputs, batch, steps, seed):
    """``steps`` steps of ``opt`` on the mean squared error of ``model`` against random targets,
    batches of ``batch`` random inputs drawn from a generator seeded with ``seed``."""
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(batch, inputs, generator=data), torch.randn(batch, outputs, generator=data)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
