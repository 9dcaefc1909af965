"""AdamW whose second moment compression cannot touch (0/1 Adam's variance rule, Lu et al. 2022).

Compression hurts AdamW mostly through ``v``: a sparse or coarse average gradient inflates or
starves it per coordinate, and Adam divides every coordinate by its ``sqrt(v)``. So
:class:`AdamW` updates ``v`` only on *exact* steps, whose average was sent uncompressed, on the
schedule of :class:`~horovod_sparse.exact_steps.ExactSteps` (``exact_warmup`` exact steps, then
intervals 1, 2, 4, ... up to ``max_interval``); every other step takes the compressed average
into the first moment ``m`` only, with ``v`` as it was at the last exact step::

    opt = hvd.DistributedOptimizer(horovod_sparse.torch.AdamW(model.parameters(), lr=3e-4),
                                   named_parameters=model.named_parameters(),
                                   compression=horovod_sparse.torch.Compression.topk(density=0.01))

No argument tells the compressor the schedule: an out-of-band compressor reads it from the
optimizer that calls it (``exact_schedule``), carries the exact steps by Horovod's allreduce
uncompressed, and reports every step as ``exact_report`` ``(index, exact)``
(:mod:`horovod_sparse.torch.out_of_band`). With ``exact_compression="fp16"`` the exact steps
travel as float16, as under Horovod's ``Compression.fp16`` (half their bytes); with ``"int8"``
out of band in 8 bits (:data:`~horovod_sparse.exact_steps.EXACT_CODES`: absmax levels over
buckets of 128 values, a quarter of their bytes, so that twice as many exact steps fit in the
same bytes as in fp16), with ``"int6"`` in 6 bits (a fifth). The compressor's own warm-up steps
stay as they are.

The optimizer never guesses: it takes ``exact`` from the report and checks the index against
its own count of exchanged steps (``exchanged_steps``, kept in each param group, so that
``state_dict()`` and ``hvd.broadcast_optimizer_state`` carry it); a report for another step
(two ``step()`` calls for one exchange, a checkpoint restored in one and not the other) or a
compressed average on a step the schedule makes exact raises RuntimeError. The compressor's
warm-up steps are exact too (reported so), and update ``v``.

In-band compressors report nothing. ``none`` (Horovod's or ours) is exact. ``fp16`` is taken
as exact: its rounding (2^-11 of each value) is far below the noise of ``v``'s estimate (not
measured here). Any other (``randomk``, ``auto``, a compressor of Horovod's own) is refused
with a ValueError at the first step: it cannot say which steps are exact. Without Horovod
(no ``_compression``) every step is exact, and the update is ``torch.optim.AdamW``'s, bit for
bit on the CPU (its single-tensor path, the same operations in the same order).

Pitfalls, and how this avoids each:

- A frozen ``v`` must not advance its bias correction: ``1 - beta2 ** step`` with beta2 = 0.999
  shrinks the corrected ``v`` about 6x between steps 100 and 1000 if ``v`` stops at 100. Here
  the correction of ``v`` is kept from its last update (``state["variance_step"]``), ``m``'s
  uses the step count, as torch's.
- Coordinates whose exact gradients are all zero have ``v`` = 0, while compressed steps (error
  feedback's delayed bursts) can give them a non-zero ``m``: ``m / (0 + eps)`` would throw them
  by ``lr / eps``. A coordinate with ``v`` = 0 takes no step until an exact step sees its
  gradient (at most ``max_interval`` steps later). Under dense training ``v`` = 0 means ``m`` = 0,
  so this changes nothing there.
- A too-early freeze: ``v`` is never frozen for good; it is refreshed at intervals at most
  ``max_interval`` apart for the whole run, after ``exact_warmup`` exact steps at the start.

How ``v`` forgets (``variance_decay``):

- ``"per_step"`` (the default): an exact step's gradient stands for every step since ``v`` last
  took one, so ``v`` decays by beta2 ** (steps covered) and takes the rest of the weight from
  the new gradient; its bias correction is ``1 - beta2 ** step`` at that exact step. ``v`` then
  remembers as many steps as dense AdamW's, whatever the intervals.
- ``"per_update"``: by beta2 per exact step (0/1 Adam's rule), corrected by the count of exact
  steps; after the warm-up its memory spans up to ``max_interval`` times more steps than dense
  AdamW's (about ``max_interval`` / (1 - beta2)).

Under both, every step exact is dense AdamW. Which does better is measured in
``docs/results/accuracy.md`` ("horovod_sparse.torch.AdamW at 1000 steps").

A step skipped by ``torch.amp.GradScaler`` (inf or NaN in some rank's gradient) never reaches
``step()``, and the compressor does not count it either: no counter moves. ``state_dict()`` /
``load_state_dict()`` are torch's: the moments, ``step``, ``exact_step`` and ``variance_step``
(the step of ``v``'s last update) per parameter, the schedule's parameters and counter per
group.
"""
import horovod.torch as hvd
import torch

from horovod_sparse.checks import check_bool, check_unit_interval
from horovod_sparse.exact_steps import DEFAULT_EXACT_WARMUP, DEFAULT_MAX_INTERVAL, ExactSteps

#: how ``v`` decays at an exact step (module docstring): by beta2 per step since its last
#: update, or by beta2 per update (0/1 Adam's rule)
VARIANCE_DECAYS = ("per_step", "per_update")
#: in-band compressors whose average is taken as exact (module docstring)
EXACT_IN_BAND = ("none", "fp16")


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (same arguments and defaults) that updates its second moment on exact
    steps only. ``exact_warmup`` (integer >= 0) and ``max_interval`` (integer >= 1) set the
    schedule (:class:`~horovod_sparse.exact_steps.ExactSteps`), ``exact_compression``
    (``"none"``, ``"fp16"``, ``"int8"`` or ``"int6"``) how its steps travel; ``variance_decay`` (one of
    ``VARIANCE_DECAYS``) how ``v`` forgets between exact steps (module docstring). ``amsgrad``, ``foreach``,
    ``fused``, ``capturable`` and ``differentiable`` are refused (ValueError) unless left off:
    this runs torch's single-tensor update."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 exact_warmup=DEFAULT_EXACT_WARMUP, max_interval=DEFAULT_MAX_INTERVAL, exact_compression="none",
                 variance_decay="per_step"):
        for name, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable),
                            ("foreach", foreach), ("fused", fused)):
            if value:
                raise ValueError(f"AdamW: {name} must be False or None (not supported), got {value!r}")
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"AdamW: lr must be a float >= 0, got {lr!r}")
        if not 0.0 <= eps:
            raise ValueError(f"AdamW: eps must be a float >= 0, got {eps!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"AdamW: weight_decay must be a float >= 0, got {weight_decay!r}")
        betas = tuple(check_unit_interval(f"betas[{i}]", b) for i, b in enumerate(betas))
        ExactSteps(exact_warmup, max_interval, exact_compression)  # checks all three
        if variance_decay not in VARIANCE_DECAYS:
            raise ValueError(f"AdamW: variance_decay must be one of {VARIANCE_DECAYS}, got {variance_decay!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        maximize=check_bool("maximize", maximize), exact_warmup=exact_warmup,
                        max_interval=max_interval, exact_compression=exact_compression, variance_decay=variance_decay,
                        exchanged_steps=0)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        """torch's, and (as torch's optimizers fill in what older states lack) a state saved
        before ``variance_decay`` was kept resumes under the rule it ran with: per update, its
        ``v`` last updated at its count of exact steps; one saved before ``exact_compression``
        sends its exact steps as they are."""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("variance_decay", "per_update")
            group.setdefault("exact_compression", "none")
        for param_state in self.state.values():
            if "exact_step" in param_state and "variance_step" not in param_state:
                param_state["variance_step"] = param_state["exact_step"].clone()

    @property
    def exact_schedule(self):
        """The :class:`~horovod_sparse.exact_steps.ExactSteps` of this optimizer (one for all groups)."""
        schedules = {(g["exact_warmup"], g["max_interval"], g["exact_compression"]) for g in self.param_groups}
        if len(schedules) != 1:
            raise ValueError(f"AdamW: exact_warmup, max_interval and exact_compression must be the same in every "
                             f"param group, got {sorted(schedules)}")
        return ExactSteps(*schedules.pop())

    def _step_is_exact(self):
        """Whether this step's gradients are an exact average (module docstring); counts an exchanged step."""
        compression = getattr(self, "_compression", None)  # set by hvd.DistributedOptimizer
        if compression is None:
            return True
        if not hasattr(compression, "exact_report"):
            if _in_band_name(compression) in EXACT_IN_BAND:
                return True
            raise ValueError(f"AdamW: the compressor {compression!r} does not report which steps are exact; use "
                             "an out-of-band compressor (topk, oktopk, qsgd, powersgd, ...) or none/fp16")
        report = compression.exact_report
        if report is None:  # no exchange yet: hvd.broadcast_optimizer_state's step on zero gradients
            return True
        index, exact = report
        count = self.param_groups[0]["exchanged_steps"]
        if index != count:
            raise RuntimeError(
                f"AdamW: the compressor's last exchanged step is {index}, this optimizer expected step {count}: "
                "step() without a new exchange (an overflowed step must be skipped, as GradScaler does), or a "
                "checkpoint restored into the optimizer and not the compressor (or the other way)")
        if not exact and self.exact_schedule.is_exact(count):
            raise RuntimeError(f"AdamW: step {count} is exact on this optimizer's schedule but the compressor sent "
                               "it compressed (a compressor shared with another optimizer?)")
        for group in self.param_groups:
            group["exchanged_steps"] = count + 1
        return exact

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        exact = self._step_is_exact()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exact_step"] = torch.tensor(0.0)
                    state["variance_step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _update(p, -p.grad if group["maximize"] else p.grad, state, group, exact)
        return loss


def _update(param, grad, state, group, exact):
    """One parameter's step: torch's ``_single_tensor_adam`` (decoupled weight decay), ``v`` and
    its correction on exact steps only, no step where ``v`` is 0."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    if group["weight_decay"] != 0:
        param.mul_(1 - lr * group["weight_decay"])
    exp_avg.lerp_(grad, 1 - beta1)
    per_step = group["variance_decay"] == "per_step"
    if exact:
        state["exact_step"] += 1
        # per step: the exact gradient stands for every step since v last took one (beta2 per
        # step covered, as dense AdamW's memory); per update: beta2 per exact step (0/1 Adam's)
        covered = (state["step"] - state["variance_step"]).item() if per_step else 1
        decay = beta2 ** covered
        exp_avg_sq.mul_(decay).addcmul_(grad, grad, value=1 - decay)
        state["variance_step"] = state["step"].clone() if per_step else state["exact_step"].clone()
    if state["exact_step"].item() == 0:  # no exact gradient yet (v all 0): nothing to scale m by
        return
    step_size = lr / (1 - beta1 ** state["step"].item())
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** state["variance_step"].item()) ** 0.5).add_(eps)
    denom.masked_fill_(exp_avg_sq == 0, float("inf"))  # m / inf = 0: no step without a scale
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _in_band_name(compression):
    """The name of an in-band compressor: Horovod's own (its class or instance), ours (a
    ``Compression.<name>`` factory or an instance of it)."""
    for name in EXACT_IN_BAND:
        horovods = getattr(hvd.Compression, name)
        if compression is horovods or isinstance(compression, horovods):
            return name
    return getattr(getattr(compression, "algorithm", None), "name", None) or getattr(compression, "name", None)
