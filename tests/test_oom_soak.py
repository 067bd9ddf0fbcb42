"""A long fit through many out-of-memory recoveries holds no more memory at its
end than at its start (issue 15: 300 steps, 100 injected OOMs)."""

import keras
import numpy as np
import tensorflow as tf

import kvram
from kvram import _train_function
from kvram.callbacks import AdaptiveBatchSize

N, BATCH = 96, 16


def network():
    """A dense net holding ~50 MB (weights, momentum, gradient sums): enough for
    the CPU allocator's counters to see what the model and a step hold."""
    inputs = keras.Input((8,))
    x = keras.layers.Dense(2048, activation="tanh")(inputs)
    x = keras.layers.Dense(2048, activation="tanh")(x)
    net = kvram.Model(inputs, keras.layers.Dense(3)(x))
    net.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
    return net


def dataset():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 8)).astype("float32")
    y = rng.standard_normal((N, 3)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_300_steps_with_100_ooms_hold_memory_flat(monkeypatch):
    calls = {"n": 0}
    original = _train_function.TrainFunction._gradients

    def failing_gradients(self):
        function = original(self)

        def run(data, micro_batch_size):
            out = function(data, micro_batch_size)  # the pass ran, its outputs held
            calls["n"] += 1
            if calls["n"] % 4 == 1:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM (injected after the pass)")
            return out

        return run

    monkeypatch.setattr(_train_function.TrainFunction, "_gradients", failing_gradients)
    marks = []

    class Watch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step % 50 == 0:
                info = tf.config.experimental.get_memory_info("CPU:0")
                marks.append((step, rss_bytes(), info["current"]))

    with tf.device("CPU:0"):
        net = network()
        controller = AdaptiveBatchSize(min_micro_batch=16, verbose=0, device="CPU:0")
        steps_per_epoch = N // BATCH
        net.fit(dataset().repeat(300 // steps_per_epoch), epochs=1, verbose=0,
                callbacks=[controller, Watch()])
    assert controller.oom_count == 100
    assert int(net.optimizer.iterations.numpy()) == 300
    (_, rss_50, held_50), (_, rss_300, held_300) = marks[0], marks[-1]
    assert held_50 > 0  # the allocator counts what the model holds
    assert held_300 == held_50, marks
    assert rss_300 - rss_50 < 16 * 2**20, marks
