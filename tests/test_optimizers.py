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


def test_values_beside_a_decade_bound_are_coded_in_their_own_decade():
    """Each decade's float32 bound and its neighbours: a value just under a bound (0.009999997 of
    the scale) takes its own decade's finest bin, not the coarser decade above (float32's log10
    put it there: an error of 7.0e-4 instead of 1.4e-4)."""
    bounds = np.float32(10.0) ** -np.arange(1, 7, dtype=np.float32)
    x = np.concatenate([[1.0], bounds, np.nextafter(bounds, 0), np.nextafter(bounds, 1)]).astype("float32")
    x = np.resize(x, 2048 * 3)
    y, scale = _round_trip(x, False)
    decade = np.clip(np.floor(np.log10(x.astype(np.float64))) + 7, 0, 6)
    half_bin = 0.45 * 10.0 ** (decade - 6) / 2.0 ** (decade + 1) * scale
    assert np.all(np.abs(y - x) <= half_bin * (1 + 1e-4)), np.max(np.abs(y - x) / half_bin)


def test_quantizing_non_finite_values_runs():
    """A skipped step's moments may be NaN/Inf (they are then not kept): quantizing them must not
    fail (a NaN decade index once did, outside XLA)."""
    for signed in (True, False):
        codes, scales = _blockwise.quantize(tf.constant([np.nan, 1.0, np.inf] + [0.5] * 61), 64, signed)
        assert codes.shape == (1, 64) and scales.shape == (1,)


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


def _factored_reference(gradients, weight, lr=1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """Adam with Adafactor's factored second moment, in float64 (no weight decay): the weights
    after each step and the rows' and columns' averages after the last. The betas as float32
    holds them (1 - 0.999 is 0.0010000467 there)."""
    beta_1, beta_2 = float(np.float32(beta_1)), float(np.float32(beta_2))
    m = np.zeros_like(weight)
    rows, columns = np.zeros(weight.shape[:-1]), np.zeros(weight.shape[:-2] + weight.shape[-1:])
    weights = []
    for step, g in enumerate(gradients, 1):
        m = beta_1 * m + (1 - beta_1) * g
        rows = beta_2 * rows + (1 - beta_2) * (g ** 2).mean(-1)
        columns = beta_2 * columns + (1 - beta_2) * (g ** 2).mean(-2)
        v = (rows / rows.mean(-1, keepdims=True))[..., None] * columns[..., None, :]
        alpha = lr * np.sqrt(1 - beta_2 ** step) / (1 - beta_1 ** step)
        weight = weight - alpha * m / (np.sqrt(v) + epsilon)
        weights.append(weight)
    return weights, rows, columns


@pytest.mark.parametrize("shape", [(48, 80), (3, 40, 24)])
def test_a_factored_second_moment_is_adafactors(shape):
    rng = np.random.default_rng(0)
    start = rng.normal(size=shape)
    gradients = [rng.normal(size=shape) * (1 + np.arange(shape[-1])) for _ in range(3)]
    weight = keras.Variable(start.astype("float32"))
    optimizer = AdamW8bit(1e-2, weight_decay=0.0, min_8bit_size=0, block_size=64, factored=True)
    optimizer.build([weight])
    weights, rows, columns = _factored_reference(gradients, start)
    optimizer.apply([tf.constant(gradients[0], tf.float32)], [weight])
    # the first step's first moment is exact (8-bit codes store later ones)
    np.testing.assert_allclose(weight.numpy(), weights[0], rtol=0, atol=1e-5)
    for g in gradients[1:]:
        optimizer.apply([tf.constant(g, tf.float32)], [weight])
    state = {v.path.split("/")[-1]: v.numpy() for v in optimizer.variables}
    got_rows = next(v for n, v in state.items() if n.endswith("velocity_rows"))
    got_columns = next(v for n, v in state.items() if n.endswith("velocity_columns"))
    np.testing.assert_allclose(got_rows, rows, rtol=1e-5)
    np.testing.assert_allclose(got_columns, columns, rtol=1e-5)
    assert not any("velocity_codes" in n for n in state)
    moved = np.abs(weights[-1] - start).mean()
    assert np.abs(weight.numpy() - weights[-1]).mean() <= 0.05 * moved


def test_a_factored_second_moment_holds_an_eighth_of_adamws_state_and_says_so():
    optimizer = AdamW8bit(min_8bit_size=0, factored=True)
    shapes = [(1024, 1024), (64, 8, 128), (4096,)]
    optimizer.build([keras.Variable(np.zeros(shape, "float32")) for shape in shapes])
    made = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables[2:])
    assert made == sum(optimizer.state_bytes(shape) for shape in shapes)
    assert optimizer.state_bytes((1024, 1024)) <= 0.15 * 2 * 4 * 1024 * 1024  # AdamW: two float32 moments
    assert optimizer.state_bytes((4096,)) == AdamW8bit(min_8bit_size=0).state_bytes((4096,))  # one axis: 8-bit


@pytest.mark.slow  # an XLA compile, a model saved and loaded
def test_a_factored_second_moment_compiles_and_is_saved(tmp_path):
    model = _weights_after(AdamW8bit(1e-3, factored=True), 8, jit=True)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.factored
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()), a.path


@pytest.mark.parametrize("kwargs, message", [
    ({"amsgrad": True}, "amsgrad"), ({"block_size": 100}, "multiple of 64, got 100"),
    ({"min_8bit_size": -1}, "non-negative integer, got -1"), ({"factored": "yes"}, "True or False, got 'yes'")])
def test_bad_arguments_say_what_was_given(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit(**kwargs)


@pytest.mark.parametrize("kwargs, message", [({"rounding": "up"}, "rounding must be one of 'stochastic', 'kahan', 'nearest', got 'up'")])
def test_a_bad_rounding_says_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit(**kwargs)


def test_float16_weights_are_refused_unless_rounded_to_the_nearest():
    weight = keras.Variable(np.ones(8, "float16"), name="w")
    with pytest.raises(ValueError, match="float16.*Allowed: float32 or bfloat16 weights, or rounding='nearest'"):
        AdamW8bit().build([weight])
    AdamW8bit(rounding="nearest").build([weight])


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    from kvram.optimizers._rounding import stochastic_round

    x = np.random.default_rng(0).normal(size=64).astype("float32") * np.float32(3.0)
    draws = 4000
    tiled = np.tile(x, (draws, 1))
    rounded = stochastic_round(tiled, tf.constant([1, 2])).numpy().astype("float32")
    down = tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), -(1 << 16)), tf.float32).numpy()
    up = tf.cast(tf.bitcast(tf.bitcast(down, tf.int32) + (1 << 16), tf.float32), tf.float32).numpy()
    assert np.all((rounded == down) | (rounded == up))
    step = np.abs(up - down)
    # the mean of 4000 draws: within 4 standard deviations (at most step / 2 / sqrt(4000)) of x
    assert np.all(np.abs(rounded.mean(0) - x) <= 4 * 0.5 * step / np.sqrt(draws))
    special = stochastic_round(np.array([np.inf, -np.inf, np.nan, 0.0], "float32"), tf.constant([0, 0])).numpy()
    assert np.isposinf(special[0]) and np.isneginf(special[1]) and np.isnan(special[2]) and special[3] == 0


def test_stochastic_rounding_draws_new_noise_per_seed_and_compiles_small():
    """Each (step, weight index) seed draws its own noise; the draw compiles to a few dozen HLO
    instructions (Philox keyed by the seed), not the ~300 of tf.random.stateless_uniform, whose
    seed scrambling made up 20,025 of a 51,481-instruction update_in_backward step at 8 blocks."""
    from kvram.optimizers._rounding import _uniform_16_bits, stochastic_round

    draws = [_uniform_16_bits([4096], tf.constant(seed)).numpy() for seed in ([1, 2], [2, 1], [1, 3], [1, 2])]
    assert np.array_equal(draws[0], draws[3])
    for other in draws[1:3]:
        assert abs(np.corrcoef(draws[0], other)[0, 1]) < 0.1
    for draw in draws:
        assert draw.min() >= 0 and draw.max() < 1 << 16 and abs(draw.mean() / (1 << 15) - 1) < 0.05
    compiled = tf.function(lambda x, seed: stochastic_round(x, seed), jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(tf.zeros([256, 512]), tf.constant([1, 2]))(stage="hlo")
    assert hlo.count(" = ") < 60


def test_kahan_summation_keeps_what_rounding_loses():
    from kvram.optimizers._rounding import kahan_add

    weight, lost = tf.constant(1.0, tf.bfloat16), tf.constant(0.0, tf.bfloat16)
    plain = tf.constant(1.0, tf.bfloat16)
    for _ in range(1000):
        weight, lost = kahan_add(weight, lost, tf.constant(1e-4))
        plain = tf.cast(tf.cast(plain, tf.float32) + 1e-4, tf.bfloat16)
    assert float(plain) == 1.0  # each 1e-4 is under half a step of 2**-7
    # the sum is kept to within one step of 2**-7 (the buffer, itself bfloat16, rounds too:
    # by at most 2**-9 of its own value, under 2**-8, each time)
    assert abs(float(weight) - 1.1) <= 2**-7 and abs(float(weight) + float(lost) - 1.1) <= 1000 * 2**-17


@pytest.fixture
def bfloat16_policy():
    keras.config.set_dtype_policy("bfloat16")
    yield
    keras.config.set_dtype_policy("float32")


def _regression(rounding, jit=False, weight_decay=0.0):
    """A bfloat16 (or float32, rounding None) linear regression from weights of 1 towards 1.05:
    its final weights and its losses."""
    keras.utils.set_random_seed(0)
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=weight_decay) if rounding is None else \
        AdamW8bit(1e-3, weight_decay=weight_decay, min_8bit_size=0, block_size=64, rounding=rounding)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")])
    model.compile(optimizer, "mse", jit_compile=jit)
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    y = x @ np.full((16, 1), 1.05, "float32")
    history = model.fit(x, y, batch_size=64, epochs=25, shuffle=False, verbose=0).history["loss"]
    return model.get_weights()[0].astype("float32"), history


@pytest.mark.parametrize("rounding, jit", [pytest.param("stochastic", True, marks=pytest.mark.slow), ("kahan", False)])
def test_bfloat16_weights_train_where_rounding_to_the_nearest_stalls(bfloat16_policy, rounding, jit):
    stalled, flat = _regression("nearest")
    assert np.all(stalled == 1.0) and flat[-1] == pytest.approx(flat[0], rel=0.05)  # each update < 2**-8
    weights, losses = _regression(rounding, jit)
    keras.config.set_dtype_policy("float32")
    reference, _ = _regression(None)
    assert losses[-1] < 0.1 * losses[0], losses
    # 100 updates of about 1e-3 each, as float32 makes them: on average within a bfloat16
    # step (2**-7 at 1) of float32's weights; measured 0.0054 (stochastic: single weights
    # wander up to 3.4 steps near the optimum), 0.0031 (kahan); nearest stays 0.0496 away
    assert np.abs(reference - 1).mean() > 0.04
    assert np.abs(weights - reference).mean() <= 2**-7, np.abs(weights - reference).mean()


def test_keras_adamw_never_moves_bfloat16_weights_and_adamw8bit_does():
    """Keras's Adam computes in the weight's dtype: in bfloat16, beta_2=0.999 is 1.0, its bias
    correction sqrt(1 - beta_2**t) is 0, and so is every update, however small the weight
    (keras-team/keras-hub#2629, keras-team/keras#21238; what benchmarks/optimizers/quality.py's
    bf16_adamw configuration shows). AdamW8bit computes the update in float32."""
    assert float(tf.cast(tf.constant(0.999), tf.bfloat16)) == 1.0
    gradient = tf.fill([256], tf.constant(0.5, tf.bfloat16))
    for optimizer, moved in ((keras.optimizers.AdamW(1e-2, weight_decay=0.0), False),
                             (AdamW8bit(1e-2, weight_decay=0.0, rounding="nearest"), True)):
        weight = keras.Variable(np.full(256, 0.01, "float32"), dtype="bfloat16", name="w")  # a step is 2**-14
        before = weight.numpy().copy()
        for _ in range(5):
            optimizer.apply_gradients([(gradient, weight)])
        assert np.any(weight.numpy() != before) == moved, (optimizer.name, weight.numpy()[:4])


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_weight_decay_of_bfloat16_weights_is_not_lost(rounding):
    weight = keras.Variable(np.ones(256, "float32"), dtype="bfloat16", name="w")
    optimizer = AdamW8bit(1e-2, weight_decay=0.1, rounding=rounding)
    zero = tf.zeros(256, tf.bfloat16)  # no gradient: Adam's update is 0, the decay alone moves it
    for _ in range(200):
        optimizer.apply_gradients([(zero, weight)])
    assert float(tf.reduce_mean(tf.cast(weight, tf.float32))) == pytest.approx(0.999**200, abs=0.01)
    nearest = keras.Variable(np.ones(256, "float32"), dtype="bfloat16", name="w")
    plain = AdamW8bit(1e-2, weight_decay=0.1, rounding="nearest")
    for _ in range(20):
        plain.apply_gradients([(zero, nearest)])
    assert np.all(nearest.numpy() == 1)  # Keras's own decay, 1e-3 of the weight, under half a step


def test_kahan_keeps_a_bfloat16_buffer_per_bfloat16_weight_and_stochastic_none():
    weights = [keras.Variable(np.ones((64, 64), "float32"), dtype="bfloat16", name="w16"),
               keras.Variable(np.ones((64, 64), "float32"), name="w32")]
    kahan, stochastic = AdamW8bit(rounding="kahan"), AdamW8bit()
    kahan.build(weights)
    stochastic.build(weights)
    extra = [v for v in kahan.variables if "kahan" in v.path]
    assert [(v.dtype, tuple(v.shape)) for v in extra] == [("bfloat16", (64, 64))]
    assert len(stochastic.variables) == len(kahan.variables) - 1


@pytest.mark.slow  # a model saved and loaded
def test_rounding_and_the_kahan_buffer_are_saved(bfloat16_policy, tmp_path):
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    model.compile(AdamW8bit(1e-3, rounding="kahan"), "mse")
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    model.fit(x, x[:, :4], epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.rounding == "kahan"
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()), a.path
