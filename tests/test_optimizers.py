import keras
import numpy as np
import pytest
import tensorflow as tf

from kvram.optimizers import AdamW8bit, _blockwise


def _values(signed):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=6000) * np.exp(rng.uniform(-16, 0, size=6000))).astype("float32")
    return x if signed else np.abs(x)


def _round_trip(x, signed):
    codes, scales = _blockwise.quantize(x, 2048, signed)
    assert codes.dtype == tf.int8 and codes.shape == (3, 2048) and scales.shape == (3,)
    y = _blockwise.dequantize(codes, scales, x.shape, signed).numpy()
    return y, np.repeat(scales.numpy(), 2048)[:x.size]


def test_a_signed_round_trip_errs_by_at_most_half_a_log_step():
    x = _values(True)
    y, scale = _round_trip(x, True)
    relative = np.abs(x) / scale
    smallest = _blockwise.magnitudes(True)[1]
    inside = relative >= smallest
    assert 0.3 < inside.mean() < 0.9  # both sides of the map's range are tested
    half_step = 10.0 ** (_blockwise.SIGNED_DECADES / _blockwise.SIGNED_CODES / 2) - 1  # 4.6%
    assert np.all(np.abs(y - x)[inside] <= half_step * np.abs(x)[inside] * (1 + 1e-4))
    assert np.all(np.sign(y[inside]) == np.sign(x[inside]))
    below = ~inside  # below the smallest code: 0 or the smallest code, whichever is nearer
    assert np.all(np.abs(y - x)[below] <= 0.5 * smallest * scale[below] * (1 + 1e-4))
    assert np.all(y[relative == 1] == x[relative == 1])  # each block's largest value is exact


def test_a_non_negative_round_trip_errs_by_at_most_half_a_bin():
    x = _values(False)
    y, scale = _round_trip(x, False)
    relative = x / scale
    decade = np.clip(np.floor(np.log10(np.maximum(relative, 1e-30))) + 7, 0, 6)
    half_bin = 0.45 * 10.0 ** (decade - 6) / 2.0 ** (decade + 1) * scale
    inside = relative >= 1e-7
    assert np.all(np.abs(y - x)[inside] <= half_bin[inside] * (1 + 1e-4) + 1e-12)
    assert np.all(y[~inside] == 0)  # below 1e-7 of the scale: zero
    assert np.all(y[inside] > 0)


def test_the_maps_use_every_code():
    for signed, size in ((True, 128), (False, 256)):
        mags = _blockwise.magnitudes(signed)
        assert len(mags) == size and mags[0] == 0 and np.all(np.diff(mags) > 0) and mags[-1] == 1.0


def _model(optimizer, jit=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(96, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=jit)
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(256, 64)).astype("float32")
    return x, x[:, :10].argmax(1)


def _weights_after(optimizer, steps, jit=False):
    model = _model(optimizer, jit)
    x, y = _data()
    model.fit(x, y, batch_size=64, epochs=steps // 4, shuffle=False, verbose=0)
    return model


def test_the_first_step_is_adamws_and_later_steps_stay_close():
    start = _model("sgd").get_weights()
    reference = _weights_after(keras.optimizers.AdamW(1e-3), 4).get_weights()
    eight_bit = _weights_after(AdamW8bit(1e-3), 4).get_weights()
    one_ref = _model(keras.optimizers.AdamW(1e-3))
    one_8 = _model(AdamW8bit(1e-3))
    x, y = _data()
    one_ref.train_on_batch(x[:64], y[:64])
    one_8.train_on_batch(x[:64], y[:64])
    for a, b in zip(one_ref.get_weights(), one_8.get_weights()):  # zero moments are stored exactly
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
    for s, a, b in zip(start, reference, eight_bit):  # after 4 steps: the updates agree to a few percent
        moved = np.abs(a - s).mean()
        assert np.abs(a - b).mean() <= 0.05 * moved, (np.abs(a - b).mean(), moved)


def test_big_variables_hold_a_quarter_of_adamws_state_and_small_ones_float32():
    model = _weights_after(AdamW8bit(1e-3), 4)
    state = {v.path.split("/")[-1]: v for v in model.optimizer.variables}
    kernel = [v for n, v in state.items() if "dense_kernel_momentum_codes" in n or n.endswith("kernel_momentum_codes")]
    assert kernel and all(v.dtype == "int8" for v in kernel)
    assert [v.dtype for n, v in state.items() if "bias_momentum" in n] == ["float32", "float32"]
    big = AdamW8bit(min_8bit_size=0)
    big.build([keras.Variable(np.zeros((1024, 1024), "float32"))])
    nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in big.variables[2:])
    assert nbytes <= 0.3 * 2 * 4 * 1024 * 1024, nbytes  # AdamW: two float32 moments


@pytest.mark.slow  # an XLA compile
def test_it_compiles_under_xla_and_in_a_loss_scale_optimizer():
    compiled = _weights_after(AdamW8bit(1e-3), 8, jit=True)
    assert all(np.all(np.isfinite(w)) for w in compiled.get_weights())
    keras.config.set_dtype_policy("mixed_float16")
    model = _weights_after(keras.optimizers.LossScaleOptimizer(AdamW8bit(1e-3)), 8)
    assert isinstance(model.optimizer.inner_optimizer, AdamW8bit)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.slow  # two models saved, loaded and trained
def test_state_is_saved_and_restored_bit_for_bit(tmp_path):
    model = _weights_after(AdamW8bit(1e-3, block_size=128), 8)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, AdamW8bit) and loaded.optimizer.block_size == 128
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()), a.path
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(tmp_path / "ckpt")
    again = _weights_after(AdamW8bit(1e-3, block_size=128), 8)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).restore(path)
    for a, b in zip(model.optimizer.variables, again.optimizer.variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    # resumed training goes on as the uninterrupted one does
    x, y = _data()
    model.train_on_batch(x[:64], y[:64])
    loaded.train_on_batch(x[:64], y[:64])
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    ({"amsgrad": True}, "amsgrad"), ({"block_size": 100}, "multiple of 64, got 100"),
    ({"min_8bit_size": -1}, "non-negative integer, got -1")])
def test_bad_arguments_say_what_was_given(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit(**kwargs)
