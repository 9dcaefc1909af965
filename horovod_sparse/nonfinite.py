"""What a step does when a gradient overflowed: the loss scaler's contract, kept.

Mixed precision with fp16 overflows by design: ``torch.amp.GradScaler`` and TensorFlow's
``LossScaleOptimizer`` start with a high scale, and a step whose gradients come out inf or
NaN is skipped while the scale is lowered. Horovod's dense allreduce keeps that contract
without knowing it: a non-finite gradient on any rank makes the sum non-finite on every
rank, and the scaler on every rank skips the step. A compressor with state must keep it
too, and more: error feedback, momenta and warm-start factors that took the inf in would
send it back at every later step, and training would stop learning with no error.

So every stateful step here (:mod:`horovod_sparse.ops.finite` says how it is checked):

1. checks whether what it is about to compress (the gradient with its residual) is finite,
   before its state changes (one reduction over a buffer it reads anyway);
2. tells the other ranks inside the exchange's agreement header, which is sent anyway (a
   dense sum needs no flag: every rank sees the same sum);
3. if any rank overflowed, exchanges nothing, changes no state (residuals, momenta,
   thresholds, warm-start factors, counters and seeds, schedule timings), and raises
   :class:`~horovod_sparse.exchange.NonFiniteGradientError` on every rank;
4. the frontend then hands Horovod a result that is NaN for every out-of-band gradient of
   the step (``nonfinite="propagate"``, the default: the scaler sees the overflow and skips
   the step, as with Horovod's dense allreduce), or raises that error on every rank
   (``nonfinite="raise"``).

The next step then runs as if the overflowed one had never been: a run with overflows
injected at some steps equals, bit for bit, a run that never saw those steps.

Example::

    compression = hvds.Compression.topk(density=0.01)                      # NaN result, scaler skips
    compression = hvds.Compression.topk(density=0.01, nonfinite="raise")   # NonFiniteGradientError
"""
from horovod_sparse.checks import check_choice

#: what a frontend does with a step whose gradient overflowed on some rank
NONFINITE_CHOICES = ("propagate", "raise")


def check_nonfinite(value):
    """``value`` if it is one of :data:`NONFINITE_CHOICES`; ValueError naming ``nonfinite`` otherwise.

    Example: ``check_nonfinite("raise") == "raise"``.
    """
    return check_choice("nonfinite", value, NONFINITE_CHOICES)


def raise_with_hint(error):
    """Re-raise the agreed :class:`~horovod_sparse.exchange.NonFiniteGradientError` with what the
    user can do (every rank raises it: the check was collective)."""
    raise type(error)(f"{error}. Skip this step (lower the loss scale) and go on: the compressor's state is "
                      "as before it; or pass nonfinite='propagate' to get a NaN result instead of this error",
                      ranks=error.ranks) from None
