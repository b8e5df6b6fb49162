"""Why each skipped step was skipped: a spike (engines/spike_guard.py), a non-finite loss or
gradient norm (engines/nonfinite.py), or an fp16 loss-scale overflow (DeepSpeed's or torch's
loss scaler). Each skipped step is counted under its reason (`skipped_by` in the train rows and
checkpoints); spikes and overflows get a record of their own (non-finite steps already have
one: loop.py)."""

from __future__ import annotations

SPIKE = "spike"
NONFINITE_LOSS = "non-finite loss"
NONFINITE_NORM = "non-finite gradient norm"
OVERFLOW = "fp16 overflow"


def reason(agreed, result) -> str | None:
    """The reason of a skipped update, None when it was applied. `agreed` is what every rank
    learned of the step (loop.py: Agreed), `result` the engine's StepResult."""
    if not agreed.skipped:
        return None
    if agreed.spiked:
        return SPIKE
    if agreed.loss_bad:
        return NONFINITE_LOSS
    return OVERFLOW if result.loss_scale is not None else NONFINITE_NORM


def account(agreed, result, state, guard, logger) -> str | None:
    """Count a skipped step under its reason in `state.skipped_by` and log spikes (with the loss
    and the gradient norm, and the limits they broke) and overflows. Returns the reason. All
    ranks call alike (the guard's figures are read on each: they are the same)."""
    why = reason(agreed, result)
    if why is None:
        return None
    state.skipped_by[why] = state.skipped_by.get(why, 0) + 1
    total = state.skipped_by[why]
    if why == SPIKE:
        f = guard.figures()
        logger.log(
            {
                "kind": "spike",
                "step": state.step,
                **f,
                "total": total,
                "note": f"spike at step {state.step}: loss {f['loss']:.4g} (limit "
                f"{f['loss_limit']:.4g}), gradient norm {f['grad_norm']:.4g} (limit "
                f"{f['grad_norm_limit']:.4g}); update skipped on every rank ({total} in total)",
            }
        )
    elif why == OVERFLOW:
        logger.log(
            {
                "kind": "overflow",
                "step": state.step,
                "loss_scale": result.loss_scale,
                "total": total,
                "note": f"fp16 gradients overflowed at step {state.step}: update skipped, loss "
                f"scale now {result.loss_scale:g} ({total} in total)",
            }
        )
    return why
