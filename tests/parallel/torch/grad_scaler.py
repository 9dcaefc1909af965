"""One step under ``torch.amp.GradScaler`` as Horovod users write it (shared by the overflow tests)."""


def grad_scaler_step(opt, scaler, loss):
    """Backward of the scaled ``loss``, then Horovod's ``synchronize()``, the scaler's unscale, its
    step under ``skip_synchronize()`` (skipped when a gradient is not finite) and update. Returns
    whether the scaler skipped the step (its scale fell)."""
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    before = scaler.get_scale()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    return scaler.get_scale() < before
