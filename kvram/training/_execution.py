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

import math

import keras
import tensorflow as tf

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


def steps_for(model, callbacks, loop: str, counts=()) -> int:
    """The steps per execution "auto" resolves to for this call of fit/evaluate/predict:
    `counts` are the batch counts the call was given (fit's `steps_per_epoch` and
    `validation_steps`, evaluate's and predict's `steps`), which it must divide."""
    if model.run_eagerly or getattr(model, "_batch_controller", None) is not None:
        return 1
    if any(sees_every_batch(c, loop) for c in _callbacks(callbacks)):
        return 1
    whole = math.gcd(*counts) if counts else 0
    return max(d for d in range(1, AUTO_STEPS + 1) if whole % d == 0)


# The batch counts each loop's call can be given (`steps_for`).
_COUNTED = {"train": ("steps_per_epoch", "validation_steps"), "test": ("steps",), "predict": ("steps",)}


def _counts(loop: str, kwargs: dict) -> dict:
    """{name: count} of the batch counts given to this call; positive ints only (Keras
    checks the rest)."""
    return {
        name: kwargs[name] for name in _COUNTED[loop]
        if isinstance(kwargs.get(name), int) and not isinstance(kwargs[name], bool) and kwargs[name] > 0
    }


def resolve(model, callbacks, loop: str, kwargs=None) -> None:
    """Sets `model.steps_per_execution` for this call where the model was compiled with
    "auto"; the compiled functions are made again only when the number changes.

    Keras runs whole executions: given `steps_per_epoch=5` with 16 steps an
    execution, its epoch runs 16 batches (plain Keras too, Keras 3.15:
    `EpochIterator` steps through the epoch `steps_per_execution` at a time). So
    "auto" takes the largest number up to 16 that divides every count the call
    was given (`kwargs`: fit's `steps_per_epoch` and `validation_steps`,
    evaluate's and predict's `steps`), and an int given to `compile()` that
    does not divide one is refused (ValueError) before anything runs."""
    counts = _counts(loop, kwargs or {})
    if not getattr(model, "_auto_steps_per_execution", False):
        given = int(getattr(model, "steps_per_execution", 1) or 1)
        for name, count in counts.items():
            if count % given:
                raise ValueError(
                    f"steps_per_execution={given} does not divide {name}={count}: Keras runs "
                    f"{given} batches a call, so it would run {-(-count // given) * given} batches "
                    f"where {count} were asked for. Compile with steps_per_execution='auto' (kvram's "
                    f"default takes the largest divisor up to {AUTO_STEPS}) or an int that divides {count}."
                )
        return
    steps = steps_for(model, callbacks, loop, tuple(counts.values()))
    if steps != model.steps_per_execution:
        model.steps_per_execution = steps
        model.train_function = model.test_function = model.predict_function = None


# Where the multi-step loop's own control (its counter, the iterator's "has a
# batch", their `and`) is computed.
HOST = "/device:CPU:0"


def multi_step_function(model, step_function):
    """Keras's TensorFlow trainer's function for `steps_per_execution` > 1
    (`TensorFlowTrainer._make_function`, Keras 3.12-3.15: a `tf.while_loop`
    over the iterator's batches, each through the compiled `step_function`),
    with the loop's control computed on the host.

    In Keras's loop the condition `logical_and(step < n, has_value())` has no
    device and lands on the GPU: its two host-memory inputs are copied to the
    GPU, the `and` queues behind the step's kernels, and the loop (TF's
    `LoopCond`, and the `tf.cond` before each step) copies it back to the host
    and waits for it. That is a wait for the whole previous step, once per
    step, and the GPU then sat idle while the host launched the next one: on
    an H200, ViT-B/16 at batch 256 had 5.2 and 2.8 ms gaps a step after those
    copies (`results/profile_vit_host_h200.json`, from the host events of
    the TF profile that `benchmarks/profile/step.py` reads). Pinned to the host, the loop's
    control needs nothing from the GPU: those copies and gaps are gone, and
    ViT-B/16 trained 1.02x faster (`results/vit_hostloop_h200.json`). Where
    the step has no XLA conditional, the host then makes no synchronizing
    CUDA call until the call's end (`benchmarks/profile/host_lead.py
    --cuda-calls` at commit 1fb3fe3, `results/cuda_calls_vit_h200.json`).

    Batches are taken as Keras takes them: the next one is fetched after each
    step except the execution's last, so no batch is drawn and dropped.
    """
    from kvram.training._train_function import _no_optionals, reduce_logs, run_steps

    strategy = model.distribute_strategy

    def one_step_on_data(data):
        return reduce_logs(strategy.run(step_function, args=(data,)), strategy)

    compiled = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)

    def one_step(data):
        return compiled(_no_optionals(data))

    def multi_step_on_iterator(iterator):
        steps = model.steps_per_execution
        # its element spec is set while the loop's body is traced (as in Keras)
        empty = tf.experimental.Optional.empty(None)

        def more(step, outputs, inputs):
            with tf.device(HOST):
                return tf.logical_and(tf.less(step, steps), inputs.has_value())

        def body(step, outputs, inputs):
            outputs = tf.experimental.Optional.from_value(one_step(inputs.get_value()))
            empty._element_spec = outputs.element_spec
            with tf.device(HOST):
                step = step + 1
                last = tf.greater_equal(step, steps)
            following = tf.cond(last, lambda: inputs, iterator.get_next_as_optional)
            return step, outputs, following

        with tf.device(HOST):
            step = tf.constant(0)
        _, outputs, _ = tf.while_loop(
            more, body, loop_vars=[step, empty, iterator.get_next_as_optional()]
        )
        outputs._element_spec = empty.element_spec
        return outputs

    multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = multi_step_on_iterator(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()
        return run_steps(model, iterator, one_step)

    function.multi_step = multi_step_on_iterator
    return function


def loop_on_host(model) -> bool:
    """Whether `model`'s train/test function is `multi_step_function`'s: several
    steps per call, traced (not eager), Keras's loop not unrolled."""
    return (
        not model.run_eagerly
        and int(model.steps_per_execution) > 1
        and int(getattr(model, "unrolled_steps_per_execution", 1)) == 1
    )
