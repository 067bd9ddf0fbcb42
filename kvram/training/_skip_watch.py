"""The callback `kvram.Model.fit` adds: warns about a run of skipped steps (their
gradients were not finite) and stops `fit()` at `max_consecutive_skips`, naming
the likely cause."""

from __future__ import annotations

import logging
import warnings

import keras
import numpy as np


_log = logging.getLogger("kvram")


# A run of skipped steps is warned about at this length, then at 10x, 100x, ...
_WARN_AFTER_SKIPS = 5


class SkipWatch(keras.callbacks.Callback):
    """Warns about a run of skipped steps and stops `fit()` at `limit` (private;
    `kvram.Model.fit` adds it). Reads kvram's counters after each step; safe to
    run on Keras's callback thread, so it does not hold up the next step."""

    async_safe = True
    _kvram_per_execution = True  # reads running counters: one look per execution is enough

    def __init__(self, limit: int | None, step_state):
        super().__init__()
        self.limit = limit
        self.step_state = step_state  # the model's `_step.StepState`: its counters
        self._warn_at = _WARN_AFTER_SKIPS
        self._epoch = 0
        self._loss_before = None  # the loss logged after the last applied step
        self._first_loss = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        run = int(self.step_state.skip_run.numpy())
        if run == 0:
            self._warn_at = _WARN_AFTER_SKIPS
            loss = (logs or {}).get("loss")
            if loss is not None and np.isfinite(loss):
                self._loss_before = float(loss)
                if self._first_loss is None:
                    self._first_loss = float(loss)
            return
        if self.limit is not None and run >= self.limit:
            raise FloatingPointError(self._diagnosis(run, batch))
        if run >= self._warn_at:
            self._warn_at *= 10
            text = (
                f"kvram.Model: {run} training steps in a row had NaN/Inf gradients and were "
                f"skipped (epoch {self._epoch + 1}, step {batch + 1}); nothing is being learned. "
                + (
                    f"fit() stops at max_consecutive_skips={self.limit}. "
                    if self.limit is not None
                    else ""
                )
                + self._cause(run)
            )
            _log.warning(text)
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def _diagnosis(self, run: int, batch: int) -> str:
        return (
            f"kvram.Model: {run} training steps in a row had NaN/Inf gradients and were "
            f"skipped (max_consecutive_skips={self.limit}; epoch {self._epoch + 1}, step "
            f"{batch + 1}). Weights and optimizer state are as after the last applied step. "
            + self._cause(run)
        )

    def _cause(self, run: int) -> str:
        model = self.model
        bad_inputs = int(self.step_state.skip_run_bad_inputs.numpy())
        if bad_inputs:
            return (
                f"Likely cause: NaN/Inf in the inputs: {bad_inputs} of these {run} batches "
                "hold non-finite values in x, y or sample_weight. Clean the data (drop or "
                "repair those rows, e.g. np.nan_to_num) or fix the preprocessing that makes them."
            )
        optimizer = model.optimizer
        loss = (
            f"the loss was {self._loss_before:.4g} before these steps"
            + (f" (it started at {self._first_loss:.4g})" if self._first_loss is not None else "")
            if self._loss_before is not None
            else "no step had a finite loss yet"
        )
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = float(np.asarray(optimizer.dynamic_scale))
            if scale <= 1.0:
                return (
                    f"Likely cause: float16 overflow. The inputs are finite, and the loss scale "
                    f"has fallen to {scale:.3g} (from {optimizer.initial_scale:g}), so values "
                    "overflow float16 (max 65504) even unscaled. Use mixed_bfloat16 "
                    "(kvram.precision.enable('mixed_bfloat16')) where the GPU supports it, or "
                    f"keep the layers that overflow in float32 (dtype='float32'); {loss}."
                )
        rate = _learning_rate(model.inner_optimizer)
        return (
            "Likely cause: the computation diverged. The inputs are finite"
            + (f"; {loss}, with learning rate {rate:.3g}" if rate is not None else f"; {loss}")
            + ". Lower the learning rate or set clip_global_norm, or look for an operation "
            "that is undefined for these values (log or sqrt of <= 0, division by zero)."
        )


def _learning_rate(optimizer):
    try:
        return float(np.asarray(optimizer.learning_rate))
    except Exception:  # noqa: BLE001 - a schedule or a custom optimizer may not say
        return None
