import keras
import numpy as np
import pytest
import tensorflow as tf

from kvram.optimizers import AdamW8bit, _blockwise


@pytest.mark.parametrize("signed", [True, False])
def test_a_round_trip_errs_by_at_most_half_a_bin(signed):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=6000) * np.exp(rng.uniform(-16, 0, size=6000))).astype("float32")
    x = x if signed else np.abs(x)
    codes, scales = _blockwise.quantize(x, 2048, signed)
    assert codes.dtype == tf.int8 and codes.shape == (3, 2048) and scales.shape == (3,)
    y = _blockwise.dequantize(codes, scales, x.shape, signed).numpy()
    relative = np.abs(x) / np.repeat(scales.numpy(), 2048)[:6000]
    decade = np.clip(np.floor(np.log10(np.maximum(relative, 1e-30))) + 7, 0, 6)
    bins = 2.0 ** decade * (1 if signed else 2)
    half_bin = 0.45 * 10.0 ** (decade - 6) / bins * np.repeat(scales.numpy(), 2048)[:6000]
    inside = relative >= 1e-7
    assert np.all(np.abs(y - x)[inside] <= half_bin[inside] * (1 + 1e-4) + 1e-12)
    assert np.all(np.abs(y[~inside]) == 0)  # below 1e-7 of the scale: zero
    assert np.all(np.sign(y[inside]) == np.sign(x[inside]))


def test_the_maps_use_every_code():
    assert len(_blockwise.magnitudes(True)) == 128 and len(_blockwise.magnitudes(False)) == 256
    assert np.all(np.diff(_blockwise.magnitudes(False)) > 0) and _blockwise.magnitudes(False)[-1] == 1.0


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
