"""`measure`: a configuration of an estimate trained for a few steps on the
present device, beside plain Keras: peak memory and samples/s."""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from kvram import memory
from kvram.remat import _plan
from kvram.remat._segments import _groups, rebuild, segments


def _fresh(optimizer):
    """A new optimizer like `optimizer` (a name or an instance), unbuilt."""
    if isinstance(optimizer, str):
        return _plan.optimizer_from(optimizer)  # a Keras name or "adamw8bit"
    return optimizer.__class__.from_config(optimizer.get_config())


def measure(build, configuration, batch_size, *, optimizer="adam", loss=None, steps=5, plain=True, kvram=True,
            log=None):
    """Trains `configuration` (and, with `plain`, the unmodified Keras model)
    for `steps` batches of random data on the present device, after one
    batch that builds and compiles: peak bytes (on the device, beyond what
    was allocated before the model was built: its variables, optimizer state,
    batch and steps) and samples/s of each (`kvram=False`: plain Keras only,
    in the configuration's precision, under "plain").

    The model `build` returns is left as it was: each run trains a model
    over its layers with its own optimizer (a new one like `optimizer`),
    and every variable of the model (weights, BatchNormalization's
    statistics, dropout's seed states) is put back afterwards. So `build`
    may return a model the caller goes on using.

    `log`, if given, is called with a line as each model's first step (its
    build and compile) is done and as its steps are: progress for a caller
    that shows it (`kvram plan --measure`), the compile often being most of
    the time."""
    say = log if log is not None else (lambda line: None)
    device = memory._device_name(None)
    previous = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(configuration.precision)
    try:
        results = {"device": device, "steps": steps}
        for kind in ("kvram",) * kvram + ("plain",) * plain:
            memory.collect_garbage()
            baseline = memory.current_bytes(device)  # what was there before: not this run's
            model = build()
            # host copies (np.array copies: a CPU tensor's buffer is not kept alive)
            saved = [(variable, np.array(variable.numpy())) for variable in model.variables]
            shape = tuple(model.inputs[0].shape[1:])
            classes = int(model.outputs[0].shape[-1] or 1)
            rng = np.random.default_rng(0)
            # One batch in host memory, repeated, as a user's data is fed: copied to
            # the device by each step (kvram.Model: prefetched). Made on the GPU, its
            # source was one more batch on the device, which training does not hold.
            with tf.device("CPU:0"):
                batch = (
                    tf.constant(rng.random((batch_size, *shape)).astype("float32")),
                    tf.constant(rng.integers(0, classes, batch_size)),
                )
            loss_name = loss or "sparse_categorical_crossentropy"
            label = "the recommendation" if kind == "kvram" else "plain Keras"
            if kind == "kvram":
                chain = segments(model)
                groups, flags = _groups(configuration.runs, len(chain))
                trained = rebuild(model, groups, flags)
                trained.compile(optimizer=_fresh(optimizer), loss=loss_name)
                trained.micro_batch_size = configuration.micro_batch_size
            else:
                # the same layers in a model of their own: the caller's model
                # keeps its optimizer and compile settings
                trained = keras.Model(model.inputs, model.outputs, name=model.name)
                trained.compile(optimizer=_fresh(optimizer), loss=loss_name)
            stepped = False
            try:
                # shuffle=False: a dataset is not shuffled by fit, which otherwise warns so
                # on every call (a line in `kvram plan --measure`'s output)
                trained.fit(tf.data.Dataset.from_tensors(batch), verbose=0, shuffle=False)  # builds, compiles
                stepped = True
                say(f"{label}: first step done (built and compiled)")
                memory.reset_peak(device)
                start = time.perf_counter()
                trained.fit(tf.data.Dataset.from_tensors(batch).repeat(steps), verbose=0, shuffle=False)
                seconds = time.perf_counter() - start
                entry = {
                    "peak_bytes": memory.peak_bytes(device) - baseline,
                    "samples_per_second": steps * batch_size / seconds,
                }
                say(f"{label}: {steps} steps done, peak {entry['peak_bytes'] / 2**30:,.2f} GiB")
            except tf.errors.ResourceExhaustedError:
                entry = {"peak_bytes": None, "samples_per_second": None, "error": "out of memory"}
                say(f"{label}: out of memory")
            finally:
                # A first step out of memory under XLA (a GPU's default) updated
                # nothing, and after it TensorFlow's GPU allocator aborted the
                # process in the next assignment to a variable (bfc_allocator.cc:808
                # `c->in_use()` in AssignVariableOp, plain Keras's ResNet50 at batch
                # 256 under 8GB on an H200): the variables are put back only after
                # steps ran.
                if stepped:
                    for variable, value in saved:
                        variable.assign(value)
            if kind == "kvram":
                results.update(entry)
            else:
                results["plain"] = entry
            del model, trained, saved
            memory.collect_garbage()
        return results
    finally:
        keras.config.set_dtype_policy(previous)
