"""`steps_per_execution="auto"`, kvram.Model's default: several batches per call into the
compiled step, unless a callback needs to see every batch.

Keras runs `steps_per_execution` batches per call of its compiled function, and calls the
callbacks' batch hooks once per call. One batch a call (Keras's default) leaves the GPU idle
while Python goes round the loop: kvram's ResNet50 step (fp16, batch 256, H200) ran 1.05x
faster with 16 batches a call than with one (benchmarks/results/resnet50_speed_h200.json,
part A). "auto" takes AUTO_STEPS batches a call where nothing is lost,
and one where a callback would miss batches: a callback (other than kvram's own step
watcher) that defines a batch hook of the loop being run, a batch-size controller
(AdaptiveBatchSize), or `run_eagerly=True`.
"""

from __future__ import annotations

import keras

AUTO = "auto"
AUTO_STEPS = 16

_HOOKS = {
    "train": ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}


def check(value) -> None:
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"steps_per_execution must be 'auto' or an int >= 1. Received: {value!r}"
        )


def _callbacks(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    if isinstance(callbacks, keras.callbacks.Callback):
        return [callbacks]
    return list(callbacks)


def sees_every_batch(callback, loop: str) -> bool:
    """Whether `callback` defines one of `loop`'s batch hooks ("train", "test", "predict"):
    in its class (overriding `keras.callbacks.Callback`'s) or set on the instance
    (`keras.callbacks.LambdaCallback`)."""
    if getattr(callback, "_kvram_per_execution", False):
        return False
    for name in _HOOKS[loop]:
        if name in vars(callback):
            return True
        method = getattr(type(callback), name, None)
        if method is not None and method is not getattr(keras.callbacks.Callback, name):
            return True
    return False


def steps_for(model, callbacks, loop: str) -> int:
    """The steps per execution "auto" resolves to for this call of fit/evaluate/predict."""
    if model.run_eagerly or getattr(model, "_batch_controller", None) is not None:
        return 1
    if any(sees_every_batch(c, loop) for c in _callbacks(callbacks)):
        return 1
    return AUTO_STEPS


def resolve(model, callbacks, loop: str) -> None:
    """Sets `model.steps_per_execution` for this call where the model was compiled with
    "auto"; the compiled functions are made again only when the number changes."""
    if not getattr(model, "_auto_steps_per_execution", False):
        return
    steps = steps_for(model, callbacks, loop)
    if steps != model.steps_per_execution:
        model.steps_per_execution = steps
        model.train_function = model.test_function = model.predict_function = None
