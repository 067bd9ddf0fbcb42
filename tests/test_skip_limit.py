"""kvram.Model's limit on skipped steps in a row: warning, error, diagnosis.

The limit is checked after each call into the compiled step. Most tests here check it step
by step, compiled with steps_per_execution=1 (one batch a call, Keras's default);
test_under_auto_steps_fit_stops_at_the_first_call_past_the_limit checks kvram's default
("auto": 16 batches a call)."""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from tests.helpers import values


def model(**kwargs):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="tanh")(inputs)
    return kvram.Model(inputs, keras.layers.Dense(1, dtype="float32")(x), **kwargs)


def batches(n, nan_rows=(), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n * 8, 8)).astype("float32")
    y = rng.standard_normal((n * 8, 1)).astype("float32")
    x[list(nan_rows)] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def fit_collecting_warnings(net, data, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            net.fit(data, verbose=0, **kwargs)
            error = None
        except FloatingPointError as raised:
            error = raised
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return error, texts


@pytest.mark.parametrize("adaptive", [False, True])
def test_all_nan_inputs_stop_fit_naming_the_inputs(adaptive):
    net = model()
    net.compile(steps_per_execution=1, optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    before = values(net.weights)
    callbacks = [kvram.callbacks.AdaptiveBatchSize(verbose=0, device="CPU:0")] if adaptive else []
    error, texts = fit_collecting_warnings(
        net, batches(40, nan_rows=range(320)), epochs=3, callbacks=callbacks
    )
    assert error is not None
    text = str(error)
    assert "20 training steps in a row had NaN/Inf gradients and were skipped" in text
    assert "max_consecutive_skips=20; epoch 1, step 20" in text
    assert "NaN/Inf in the inputs: 20 of these 20 batches hold non-finite values" in text
    assert any("5 training steps in a row" in t and "fit() stops at max_consecutive_skips=20" in t
               for t in texts)
    assert net.skipped_steps == 20 and int(net.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, values(net.weights)):
        np.testing.assert_array_equal(a, b)


def test_a_diverged_run_names_the_loss_and_learning_rate():
    net = model()
    net.compile(steps_per_execution=1, optimizer=keras.optimizers.SGD(1e30), loss="mse")
    error, _ = fit_collecting_warnings(net, batches(40), epochs=2)
    assert error is not None
    text = str(error)
    assert "Likely cause: the computation diverged. The inputs are finite" in text
    assert re.search(r"the loss was \S+ before these steps \(it started at \S+\), with learning "
                     r"rate 1e\+30", text), text
    assert net.skipped_steps == 20


def test_float16_overflow_with_the_loss_scale_below_one():
    kvram.precision.enable("mixed_float16")
    inputs = keras.Input((8,))
    big = keras.layers.Dense(16, kernel_initializer=keras.initializers.Constant(3e4))(inputs)
    net = kvram.Model(inputs, keras.layers.Dense(1, dtype="float32")(big))
    net.compile(steps_per_execution=1, optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    error, _ = fit_collecting_warnings(net, batches(40), epochs=1)
    assert error is not None
    text = str(error)
    assert "Likely cause: float16 overflow. The inputs are finite, and the loss scale has " \
           "fallen to 0.0312 (from 32768)" in text, text


def test_a_run_that_ends_resets_and_none_means_no_limit():
    # NaN batches 0-3, 10-13 and 20-23 (runs of 4): below the warning, never an error.
    rows = [r for start in (0, 10, 20) for r in range(start * 8, (start + 4) * 8)]
    net = model()
    net.compile(steps_per_execution=1, optimizer="sgd", loss="mse")
    error, texts = fit_collecting_warnings(net, batches(30, nan_rows=rows), epochs=1)
    assert error is None and texts == [] and net.skipped_steps == 12
    # No limit: warned at 5 and 50 skipped steps in a row, never stopped.
    unlimited = model(max_consecutive_skips=None)
    unlimited.compile(steps_per_execution=1, optimizer="sgd", loss="mse")
    error, texts = fit_collecting_warnings(unlimited, batches(60, nan_rows=range(480)), epochs=1)
    assert error is None and unlimited.skipped_steps == 60
    assert [re.match(r"kvram.Model: (\d+) training", t).group(1) for t in texts] == ["5", "50"]
    assert all("fit() stops" not in t for t in texts)


def test_a_nan_replica_is_diagnosed_as_bad_inputs(mirrored):
    with mirrored.scope():
        net = model(max_consecutive_skips=3)
        net.compile(steps_per_execution=1, optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype("float32")
    x[12::16] = np.nan  # one row in the second replica's half of every global batch of 16
    with pytest.raises(FloatingPointError, match="NaN/Inf in the inputs: 3 of these 3 batches"):
        net.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, shuffle=False)


@pytest.mark.parametrize(
    "value, error, text",
    [
        (0, ValueError, r"`max_consecutive_skips` must be an int >= 1. Received: max_consecutive_skips=0"),
        ("20", TypeError, r"Received: max_consecutive_skips='20' of type str"),
    ],
)
def test_bad_max_consecutive_skips(value, error, text):
    with pytest.raises(error, match=text):
        model(max_consecutive_skips=value)


def test_config_round_trip(tmp_path):
    net = model(max_consecutive_skips=7)
    net.compile(steps_per_execution=1, optimizer="sgd", loss="mse")
    path = str(tmp_path / "m.keras")
    net.save(path)
    assert keras.saving.load_model(path).max_consecutive_skips == 7


def test_pipeline_model_diagnoses_nan_inputs():
    from kvram.parallel import PipelineModel

    net = PipelineModel(
        [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)],
        ["CPU:0", "CPU:1"], micro_batches=2, max_consecutive_skips=4,
    )
    net.build((None, 8))
    net.compile(steps_per_execution=1, optimizer="sgd", loss="mse")
    with pytest.raises(FloatingPointError, match="NaN/Inf in the inputs: 4 of these 4 batches"):
        net.fit(batches(10, nan_rows=range(80)), epochs=1, verbose=0)
    assert int(net.optimizer.iterations.numpy()) == 0


def test_under_auto_steps_fit_stops_at_the_first_call_past_the_limit():
    net = model()
    net.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")  # steps_per_execution="auto"
    before = values(net.weights)
    error, texts = fit_collecting_warnings(net, batches(80, nan_rows=range(640)), epochs=2)
    assert net.steps_per_execution == 16
    assert error is not None
    text = str(error)
    # 20 is reached inside the second call of 16 batches: fit stops at its end, step 32.
    assert "32 training steps in a row had NaN/Inf gradients and were skipped" in text
    assert "max_consecutive_skips=20; epoch 1, step 32" in text
    assert "NaN/Inf in the inputs: 32 of these 32 batches hold non-finite values" in text
    assert any("16 training steps in a row" in t for t in texts)
    assert net.skipped_steps == 32 and int(net.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, values(net.weights)):
        np.testing.assert_array_equal(a, b)
