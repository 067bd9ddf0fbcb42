"""A model split across two devices with micro-batch pipelining.

On a machine with two GPUs the stages go to GPU:0 and GPU:1; without them, the
CPU is split into two logical devices so the same code runs anywhere.
kvram.parallel.balance splits the layers by measured memory, PipelineModel
trains them with 4 micro-batches per batch, and the printout shows where each
stage's variables live and that the loss goes down.

    python examples/two_device_split.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram  # noqa: E402
import tensorflow as tf  # noqa: E402


def devices():
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= 2:
        return ["GPU:0", "GPU:1"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or []) < 2:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * 2
            )
        except RuntimeError:
            pass  # TF already started; use what it has
    return ["CPU:0", "CPU:1"]


def main(argv=None):
    names = devices()
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(n, activation="relu") for n in (256, 256, 64, 64)] + [keras.layers.Dense(1)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    plan = kvram.parallel.balance(layers, names, by="memory", sample_batch=x[:64])
    print(plan.report)
    model = kvram.parallel.PipelineModel(plan.stages, plan.devices, micro_batches=4)
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=64, epochs=5, verbose=2)
    for stage, device in zip(model.stages, model.device_names):
        print(f"{stage.name}: variables on {sorted({v.value.device.split('device:')[-1] for v in stage.weights})}"
              f" (asked for {device.split('device:')[-1]})")
    return history.history["loss"]


if __name__ == "__main__":
    main()
