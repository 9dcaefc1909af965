"""Tiny models for the CLI's ``profile`` tests (``--model whatif_tiny_model:tiny``), one per
factory convention of docs/results/whatif.md."""
import torch


class Tiny(torch.nn.Module):
    """Two Linear layers; ``example_batch(B)`` gives ``(x, y)`` for an MSE loss."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))

    def forward(self, x):
        return self.net(x)

    def example_batch(self, batch):
        gen = torch.Generator().manual_seed(0)
        return torch.randn(batch, 64, generator=gen), torch.randn(batch, 8, generator=gen)


def tiny():
    """A model with ``example_batch``."""
    torch.manual_seed(0)
    return Tiny()


def tiny_classifier():
    """``(model, make_batch, loss_fn)`` with integer labels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))), torch.nn.functional.cross_entropy


def not_a_model():
    return 42
