"""Training recipes: the optimizer and learning-rate schedule a workload's users train with.

A :class:`Recipe` is plain data (optimizer, learning rate, momentum, weight decay, warm-up
fraction, decay) and makes the two torch objects a training loop needs:

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> recipe = RECIPES["adamw"]
    >>> opt = recipe.optimizer(model.parameters())
    >>> schedule = recipe.schedule(opt, total_steps=100)   # call schedule.step() after opt.step()
    >>> [round(recipe.lr_factor(s, 100), 3) for s in (0, 9, 10, 55, 99)]
    [0.1, 1.0, 1.0, 0.5, 0.0]

The three recipes, named by what users call them (a workload module may set its own
learning rates in ``RECIPES`` and its default in ``RECIPE``):

* ``sgd``: plain SGD, constant rate (the recipe of the earlier studies);
* ``momentum``: SGD with momentum 0.9 and weight decay 1e-4, linear warm-up over the first
  10% of the steps, then cosine decay to zero (the CNN recipe);
* ``adamw``: AdamW, weight decay 0.01, the same warm-up and cosine decay (the transformer
  recipe);
* ``adamw-exact``: the same with :class:`horovod_sparse.torch.AdamW`, whose second moment is
  updated on exact steps only, for the compressors under AdamW: its default schedule, or the
  one a spec names as compressors' specs do (``adamw-exact:exact_warmup=200,exact_compression=fp16``;
  ``EXACT_OPTIONS``).

    >>> recipe_for(None, "adamw-exact:exact_compression=fp16").options
    (('exact_compression', 'fp16'),)
"""
import argparse
import math
from dataclasses import asdict, dataclass, replace

from horovod_sparse.registry import parse_spec

NAMES = ("sgd", "momentum", "adamw", "adamw-exact")
#: the arguments of horovod_sparse.torch.AdamW an ``adamw-exact`` spec may set
EXACT_OPTIONS = ("exact_warmup", "max_interval", "exact_compression", "variance_decay")
#: compressors that apply the optimizer's momentum themselves: trained with momentum 0
OWN_MOMENTUM = ("dgc", "signum")


@dataclass(frozen=True)
class Recipe:
    """One training recipe. ``warmup``: fraction of the steps with a linear warm-up of the rate
    (from ``1/warmup_steps`` of it); ``decay``: ``"cosine"`` (to zero at the last step) or
    ``"constant"``."""

    name: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    warmup: float = 0.0
    decay: str = "constant"
    options: tuple = ()  # (name, value) pairs for the optimizer: an ``adamw-exact`` spec's ``EXACT_OPTIONS``

    def optimizer(self, params):
        """The torch optimizer of this recipe over ``params``."""
        import torch
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.name == "adamw-exact":
            from horovod_sparse.torch import AdamW
            return AdamW(params, lr=self.lr, weight_decay=self.weight_decay, **dict(self.options))
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def lr_factor(self, step, total_steps):
        """The rate at 0-based ``step`` of ``total_steps``, as a fraction of ``lr``."""
        warm = math.ceil(self.warmup * total_steps)
        if step < warm:
            return (step + 1) / warm
        if self.decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total_steps - warm)))
        return 1.0

    def schedule(self, optimizer, total_steps):
        """A ``LambdaLR`` following :meth:`lr_factor` (step it once per optimizer step)."""
        import torch
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_factor(step, total_steps))

    def for_compressor(self, spec):
        """This recipe as it runs under compressor ``spec``: momentum 0 where the compressor
        applies the momentum itself (DGC's momentum correction, Signum), as their papers train."""
        name = spec.split(":", 1)[0]
        return replace(self, momentum=0.0) if name in OWN_MOMENTUM and self.momentum else self

    def with_lr(self, lr):
        """The same recipe at another learning rate (None: this one)."""
        return self if lr is None else replace(self, lr=float(lr))

    def record(self):
        """The recipe as a dict, for benchmark records."""
        return asdict(self)


#: the recipes at rates that suit a small transformer; workloads override ``lr`` in their own ``RECIPES``
RECIPES = {
    "sgd": Recipe("sgd", lr=0.03),
    "momentum": Recipe("momentum", lr=0.1, momentum=0.9, weight_decay=1e-4, warmup=0.1, decay="cosine"),
    "adamw": Recipe("adamw", lr=1e-3, weight_decay=0.01, warmup=0.1, decay="cosine"),
}


def recipe_spec(spec):
    """``spec`` if it names a recipe (:func:`recipe_for`'s ``name``): an ``argparse`` type, so
    that a bad ``--recipe`` fails before any rank starts, saying why (ArgumentTypeError)."""
    try:
        _parse_recipe(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return spec


def _parse_recipe(spec):
    """``spec`` as ``(name, {option: value})``; ValueError where the name is not a recipe's or an
    option not among its own (``adamw-exact``'s ``EXACT_OPTIONS``; the others take none)."""
    name, options = parse_spec(spec)
    if name not in NAMES:
        raise ValueError(f"recipe must be one of {', '.join(NAMES)}, got {spec!r}")
    allowed = EXACT_OPTIONS if name == "adamw-exact" else ()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"recipe {spec!r}: {', '.join(unknown)} not among its options "
                         f"({', '.join(allowed) or 'none'})")
    return name, options


def recipe_for(workload, name=None, lr=None):
    """The recipe ``name`` (default: the workload's ``RECIPE``; ``adamw-exact`` with options as
    ``adamw-exact:max_interval=16``) with the workload's own rates (its ``RECIPES``, where it
    sets them) and ``lr`` where given."""
    name, options = _parse_recipe(name or getattr(workload, "RECIPE", "sgd"))
    own = getattr(workload, "RECIPES", {})
    if name == "adamw-exact":  # the workload's AdamW rates, the exact-step optimizer
        return replace(own.get("adamw", RECIPES["adamw"]), name=name, options=tuple(options.items())).with_lr(lr)
    return own.get(name, RECIPES[name]).with_lr(lr)
