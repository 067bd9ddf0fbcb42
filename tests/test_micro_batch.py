import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from tests.helpers import in_own_process, max_rel_diff

TOL = 1e-5


def model(micro_batch_size=None, jit_compile=False, dropout=False, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(32, activation="tanh")(inputs)
    x = kvram.layers.Checkpoint(keras.layers.Dense(16, activation="relu"))(x)
    outputs = keras.layers.Dense(3)(x)
    net = kvram.Model(inputs, outputs, micro_batch_size=micro_batch_size, **kwargs)
    net.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=["mae"],
        jit_compile=jit_compile,
    )
    return net


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    y = rng.standard_normal((n, 3)).astype("float32")
    w = rng.uniform(0.2, 2.0, n).astype("float32")
    return x, y, w


@pytest.mark.parametrize(
    "batch, micro, jit, weighted",
    [
        (16, 4, False, False),  # divides the batch
        (16, 5, False, False),  # does not: slices 5, 5, 5, 1
        (16, 7, True, True),  # XLA per slice, sample weights
        (16, 16, False, True),  # one slice
        (16, 40, False, False),  # larger than the batch
    ],
)
def test_micro_batches_give_the_full_batch_update(batch, micro, jit, weighted):
    x, y, w = data(batch)
    whole = model()
    sliced = model(micro_batch_size=micro, jit_compile=jit)
    for a, b in zip(whole.weights, sliced.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    kwargs = {"sample_weight": w} if weighted else {}
    h_whole = whole.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, **kwargs)
    h_sliced = sliced.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, **kwargs)
    assert max_rel_diff(
        [v.numpy() for v in whole.trainable_weights], [v.numpy() for v in sliced.trainable_weights]
    ) < TOL
    for key in ("loss", "mae"):
        assert h_sliced.history[key][0] == pytest.approx(h_whole.history[key][0], rel=TOL)
    assert int(sliced.optimizer.iterations.numpy()) == 1


def test_micro_batches_over_epochs_with_a_short_last_batch():
    x, y, _ = data(50)
    whole, sliced = model(), model(micro_batch_size=3)
    whole.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    sliced.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_rel_diff(
        [v.numpy() for v in whole.trainable_weights], [v.numpy() for v in sliced.trainable_weights]
    ) < TOL
    assert int(sliced.optimizer.iterations.numpy()) == 2 * 4


@pytest.mark.slow
def test_micro_batches_lower_peak_memory(request):
    # fit()'s peak, in a process of its own, as the suite's other fit() peaks are: in the
    # suite's process what earlier tests left (threads that allocate, the allocator's free
    # blocks) counts with it (alone: 88.0 and 32.0 MiB, the bar 44.0)
    if in_own_process(request):
        return
    keras.utils.set_random_seed(0)

    def wide(micro):
        inputs = keras.Input((64,))
        x = inputs
        for _ in range(4):
            x = keras.layers.Dense(1024, activation="relu")(x)
        net = kvram.Model(inputs, keras.layers.Dense(1)(x), micro_batch_size=micro)
        net.compile(optimizer="sgd", loss="mse")
        return net

    batch = tf.data.Dataset.from_tensors(
        (np.ones((4096, 64), "float32"), np.ones((4096, 1), "float32"))
    )
    peaks = {}
    with tf.device("CPU:0"):
        for micro in (None, 32):
            net = wide(micro)
            net.fit(batch, epochs=1, verbose=0)  # trace and build
            kvram.memory.reset_peak("CPU:0")
            start = kvram.memory.current_bytes("CPU:0")
            net.fit(batch, epochs=1, verbose=0)
            peaks[micro] = kvram.memory.peak_bytes("CPU:0") - start
    # Activations: 4096 rows x 4 layers x 1024 float32 = 64 MiB, 0.5 MiB per slice
    # of 32; the slices add one gradient-sized running sum (3.2M params, 13 MiB).
    print({k: v / 2**20 for k, v in peaks.items()})
    assert peaks[32] < 0.5 * peaks[None], peaks


def test_micro_batch_size_round_trips_and_can_change():
    net = model(micro_batch_size=4)
    assert net.get_config()["micro_batch_size"] == 4
    x, y, _ = data(16)
    net.fit(x, y, batch_size=16, verbose=0)
    net.micro_batch_size = None
    net.fit(x, y, batch_size=16, verbose=0)
    net.micro_batch_size = 8
    net.fit(x, y, batch_size=16, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize(
    "value, error, text",
    [
        (0, ValueError, "micro_batch_size=0"),
        (2.5, TypeError, "micro_batch_size=2.5"),
        ("8", TypeError, "micro_batch_size='8'"),
    ],
)
def test_bad_micro_batch_size(value, error, text):
    with pytest.raises(error, match=text):
        model(micro_batch_size=value)


def test_micro_batches_need_mean_losses():
    inputs = keras.Input((8,))
    net = kvram.Model(inputs, keras.layers.Dense(1)(inputs), micro_batch_size=4)
    with pytest.raises(ValueError, match="reduction='sum'"):
        net.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))


def test_custom_train_step_is_refused_with_micro_batches():
    class Custom(kvram.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((8,))
    net = Custom(inputs, keras.layers.Dense(3)(inputs), micro_batch_size=4)
    net.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(8)
    with pytest.raises(NotImplementedError, match="overrides train_step"):
        net.fit(x, y, verbose=0)


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_fixed_micro_batches_compile_the_whole_step_with_xla(request):
    """With jit_compile, the loop over slices, the sums and the update are one XLA
    computation per batch shape (a short last batch is a second one), with the
    same result as slices compiled alone under TF's graph executor."""
    if in_own_process(request):
        return
    x, y, w = data(38)
    whole_xla = model(micro_batch_size=5, jit_compile=True)
    slices_xla = model(micro_batch_size=5, jit_compile=True)
    slices_xla._kvram_xla_micro_step = False
    whole = model()
    for net in (whole_xla, slices_xla, whole):
        net.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights = [[v.numpy() for v in net.trainable_weights] for net in (whole_xla, slices_xla, whole)]
    assert max_rel_diff(weights[2], weights[0]) < TOL
    assert max_rel_diff(weights[1], weights[0]) < TOL
    assert list(whole_xla.train_function._functions) == [("fused_xla", 5)]
    assert list(slices_xla.train_function._functions) == [("fused", 5)]
    # batches of 16 and a last one of 6: one trace each
    assert whole_xla.train_function.tracing_count() == 2


# Slices too small for BatchNormalization's batch statistics


def _dense_bn(micro_batch_size=None, **kwargs):
    inputs = keras.Input((4,))
    x = keras.layers.Dense(16)(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x, **kwargs)
    x = keras.layers.ReLU()(x)
    return kvram.Model(inputs, keras.layers.Dense(2)(x), micro_batch_size=micro_batch_size)


ONE_ROW = (
    r"^micro_batch_size=1 trains each row alone, and BatchNormalization layer\(s\) \['bn'\] normalise over "
    r"the batch axis alone \(a \(batch, features\) input\): over one row their output is their beta, "
    r"whatever the input, so no layer before them learns\. Use micro_batch_size >= 2 \(the larger, the "
    r"closer to whole batches\), or replace them with LayerNormalization or GroupNormalization, which do "
    r"not use the batch\. Received: micro_batch_size=1$"
)


def test_one_row_slices_through_a_dense_batch_norm_are_refused():
    with pytest.raises(ValueError, match=ONE_ROW):
        _dense_bn(micro_batch_size=1)
    net = _dense_bn(micro_batch_size=None)
    with pytest.raises(ValueError, match=ONE_ROW):
        net.micro_batch_size = 1
    assert net.micro_batch_size is None

    class Net(kvram.Model):  # subclassed: its layers are known once traced, in fit()
        def __init__(self):
            super().__init__(micro_batch_size=1)
            self.dense, self.bn, self.out = keras.layers.Dense(16), keras.layers.BatchNormalization(name="bn"), \
                keras.layers.Dense(2)

        def call(self, x, training=False):
            return self.out(keras.ops.relu(self.bn(self.dense(x), training=training)))

    net = Net()
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    with pytest.raises(ValueError, match=ONE_ROW[1:-1]):  # raised while tracing: TF adds "in user code"
        net.fit(x, (x[:, 0] > 0).astype("int32"), batch_size=8, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == 0


def test_batch_norm_that_uses_moving_statistics_or_sees_pixels_is_not_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _dense_bn(micro_batch_size=1, training=False)  # frozen in the graph
        net = _dense_bn()
        net.get_layer("bn").trainable = False
        net.micro_batch_size = 1
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(4, 3)(inputs)
    x = keras.layers.BatchNormalization(name="conv_bn")(x)  # 16 values per row per statistic
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x))
    with pytest.warns(UserWarning, match=r"micro_batch_size=1: BatchNormalization layer\(s\) \['conv_bn'\] take "
                      r"their statistics over each slice of 1 rows, not over the whole batch; under 8 rows"):
        kvram.Model(inputs, outputs, micro_batch_size=1)


def test_a_one_row_last_slice_through_a_dense_batch_norm_warns():
    net = _dense_bn(micro_batch_size=8)
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).standard_normal((9, 4)).astype("float32")
    with pytest.warns(UserWarning, match=r"A batch of 9 rows at micro_batch_size=8 leaves a last slice of "
                      r"one row: BatchNormalization layer\(s\) \['bn'\] normalise it to a constant"):
        net.fit(x, (x[:, 0] > 0).astype("int32"), batch_size=9, verbose=0)


def test_adaptive_batch_size_keeps_two_rows_a_slice_for_a_dense_batch_norm(capsys):
    from kvram.callbacks import rungs

    assert rungs(9, 1) == [9, 5, 3, 2, 1]
    assert rungs(9, 2, least_slice=2) == [9, 5, 3]  # 2 would leave a one-row slice (2,2,2,2,1)
    net = _dense_bn()
    net.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).standard_normal((16, 4)).astype("float32")
    callback = kvram.callbacks.AdaptiveBatchSize(probe=False)
    net.fit(x, (x[:, 0] > 0).astype("int32"), batch_size=16, epochs=1, verbose=0, callbacks=[callback])
    assert callback.min_micro_batch == 2
    assert "min_micro_batch raised from 1 to 2: a BatchNormalization layer normalises over the batch " \
        "axis alone" in capsys.readouterr().out
