"""kvram.speed and kvram.layers.FusedBatchNormalization: same function, same
gradients, same moving statistics as Keras's BatchNormalization; the GPU
prefetch of kvram.Model.fit leaves the data unchanged."""

import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from helpers import max_rel_diff, values


def _pair(policy, **kwargs):
    keras.config.set_dtype_policy(policy)
    plain = keras.layers.BatchNormalization(**kwargs)
    fused = kvram.layers.FusedBatchNormalization(**kwargs)
    shape = (6, 5, 4, 8)
    for layer in (plain, fused):
        layer.build(shape)
    rng = np.random.default_rng(0)
    for a, b in zip(plain.weights, fused.weights):
        value = rng.uniform(0.5, 1.5, a.shape).astype("float32")
        a.assign(value)
        b.assign(value)
    return plain, fused, tf.constant(rng.normal(1.0, 3.0, shape).astype("float32"))


_LOSS_WEIGHTS = np.random.default_rng(1).normal(size=(6, 5, 4, 8)).astype("float32")


def _step(layer, x, training):
    weights = [w for w in (getattr(layer, "gamma", None), getattr(layer, "beta", None)) if w is not None]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        # a fixed random weighting: its gradient through the normalization is far from 0
        loss = tf.reduce_sum(tf.cast(y, "float32") * _LOSS_WEIGHTS)
    return y, tape.gradient(loss, [x, *weights])


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy,tol", [("float32", 1e-5), ("mixed_float16", 2e-2), ("mixed_bfloat16", 5e-2)]
)
@pytest.mark.parametrize("kwargs", [{}, {"center": False}, {"scale": False, "epsilon": 0.1}])
def test_fused_batch_norm_matches_keras(policy, tol, kwargs):
    plain, fused, x = _pair(policy, momentum=0.9, **kwargs)
    for training in (True, False):
        y_plain, g_plain = _step(plain, x, training)
        y_fused, g_fused = _step(fused, x, training)
        assert y_fused.dtype == y_plain.dtype
        assert max_rel_diff([y_plain], [y_fused]) < tol
        assert max_rel_diff(g_plain, g_fused) < tol
    # moving statistics: Keras's formula with the biased batch variance
    assert max_rel_diff(values(plain.non_trainable_weights), values(fused.non_trainable_weights)) < 1e-5


def test_fused_batch_norm_under_xla_matches_keras():
    plain, fused, x = _pair("float32")
    step = tf.function(lambda x: _step(fused, x, True), jit_compile=True)
    y_fused, g_fused = step(x)
    y_plain, g_plain = _step(plain, x, True)
    assert max_rel_diff([y_plain], [y_fused]) < 1e-5
    assert max_rel_diff(g_plain, g_fused) < 1e-4


def test_fused_batch_norm_falls_back_where_it_cannot_fuse():
    keras.config.set_dtype_policy("float32")
    x = tf.random.normal((4, 3, 8))  # 3-D: Keras's implementation
    plain, fused = keras.layers.BatchNormalization(), kvram.layers.FusedBatchNormalization()
    assert max_rel_diff([plain(x, training=True)], [fused(x, training=True)]) < 1e-6
    x4 = tf.random.normal((2, 8, 3, 3))
    plain, fused = keras.layers.BatchNormalization(axis=1), kvram.layers.FusedBatchNormalization(axis=1)
    assert max_rel_diff([plain(x4, training=True)], [fused(x4, training=True)]) < 1e-6


def test_fused_batch_norm_config_and_save(tmp_path):
    layer = kvram.layers.FusedBatchNormalization(momentum=0.8, epsilon=1e-4)
    clone = kvram.layers.FusedBatchNormalization.from_config(layer.get_config())
    assert (clone.momentum, clone.epsilon) == (0.8, 1e-4)
    inputs = keras.Input((4, 4, 3))
    model = keras.Model(inputs, layer(inputs))
    model(tf.ones((1, 4, 4, 3)), training=True)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.layers[-1], kvram.layers.FusedBatchNormalization)
    assert max_rel_diff(model.get_weights(), loaded.get_weights()) == 0


def _resnetish(kvram_model=False):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    block_in = keras.Input((8, 8, 8))
    h = keras.layers.Conv2D(8, 1)(block_in)
    h = keras.layers.BatchNormalization()(h)
    block = keras.Model(block_in, keras.layers.ReLU()(h))
    x = kvram.layers.Checkpoint(block)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(4)(x)
    return (kvram.Model if kvram_model else keras.Model)(inputs, outputs)


def test_fuse_batch_norm_switches_nested_layers_and_keeps_training_identical():
    x = tf.random.normal((8, 8, 8, 3), seed=1)
    y = tf.constant([0, 1, 2, 3] * 2)
    plain, fused = _resnetish(), _resnetish()
    assert kvram.speed.fuse_batch_norm(fused) == 2  # one inside the checkpointed block
    assert sum(isinstance(l, kvram.layers.FusedBatchNormalization)
               for l in fused._flatten_layers(include_self=False)) == 2
    for model in (plain, fused):
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    # per_tensor=False: the conv biases feeding BatchNormalization, and the first
    # BN's beta (a per-channel shift the next BN removes), have analytically zero
    # gradients whose rounding noise differs
    assert max_rel_diff(plain.get_weights(), fused.get_weights(), per_tensor=False) < 1e-5
    assert kvram.speed.fuse_batch_norm(fused) == 0  # already fused


def test_fuse_batch_norm_drops_traced_functions():
    model = _resnetish()
    model.compile("sgd", "mse")
    model.fit(tf.ones((2, 8, 8, 3)), tf.ones((2, 4)), verbose=0)
    assert model.train_function is not None
    kvram.speed.fuse_batch_norm(model)
    assert model.train_function is None


def test_fuse_batch_norm_rejects_non_layers():
    with pytest.raises(TypeError, match=r"Received: model='resnet'"):
        kvram.speed.fuse_batch_norm("resnet")


def test_prefetch_to_gpu_argument_checked():
    with pytest.raises(ValueError, match=r"Received: prefetch_to_gpu=0"):
        _model(prefetch_to_gpu=0)
    with pytest.raises(TypeError, match=r"Received: prefetch_to_gpu='2'"):
        _model(prefetch_to_gpu="2")
    assert _model(prefetch_to_gpu=None).prefetch_to_gpu is None
    assert _model().prefetch_to_gpu == 2


def _model(**kwargs):
    inputs = keras.Input((3,))
    return kvram.Model(inputs, keras.layers.Dense(1)(inputs), **kwargs)


def test_prefetch_applies_to_datasets_on_a_device_and_keeps_the_data(monkeypatch):
    """On the CPU there is no GPU to prefetch to: with one stood in by a logical
    CPU device, fit() trains on exactly the same batches as without prefetching."""
    data = tf.data.Dataset.from_tensor_slices(
        (np.arange(24, dtype="float32").reshape(8, 3), np.arange(8, dtype="float32"))
    ).batch(4)
    without = _model(prefetch_to_gpu=None)
    assert without._prefetched(data) is data
    cpu = tf.config.list_logical_devices("CPU")[0]
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: [cpu] if kind == "GPU" else [cpu])
    model = _model()
    assert model._prefetched(data) is not data
    array = np.ones((2, 3))
    assert model._prefetched(array) is array  # arrays pass unchanged
    keras.utils.set_random_seed(0)
    a = _model(prefetch_to_gpu=None)
    keras.utils.set_random_seed(0)
    b = _model()
    for m in (a, b):
        m.compile(keras.optimizers.SGD(0.01), "mse")
        m.fit(data, epochs=2, verbose=0)
    assert max_rel_diff(a.get_weights(), b.get_weights()) == 0


def test_pin_host_memory_after_tensorflow_started_says_what_to_move():
    tf.constant(1.0)  # the runtime has started in this process
    if kvram.speed.host_memory_pinned():
        pytest.skip("this process already pins host memory")
    with pytest.raises(RuntimeError, match=r"before TensorFlow's first operation.*force_gpu_compatible"):
        kvram.speed.pin_host_memory()


_PINNED_RUN = """
import numpy as np, tensorflow as tf, keras, kvram
from tensorflow.python.eager import context
kvram.speed.pin_host_memory()
kvram.speed.pin_host_memory()  # again: no error
x = np.random.default_rng(0).random((32, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
inputs = keras.Input((4,))
model = kvram.Model(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
config = context.context().config  # what the runtime was started with
print("pinned", kvram.speed.host_memory_pinned(), config.gpu_options.force_gpu_compatible)
"""


@pytest.mark.slow
def test_pin_host_memory_at_program_start_reaches_the_runtime(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _PINNED_RUN], capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pinned True True" in out.stdout


def _vit_tiny_step(lean, policy="float32", jit=False):
    """Loss, gradients and the step peak of models/vit.py's vit_tiny (Keras
    MultiHeadAttention, exact GELUs, LayerNormalizations), with or without
    `lean_activations`."""
    from models.vit import vit_tiny
    from tests.helpers import run_with_peak

    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = vit_tiny(attention="keras", checkpoint=False, mlp=512)
        if lean:
            assert kvram.speed.lean_activations(model) == 4 * 3 + 1  # a block's two norms and GELU; the final norm
        x = tf.random.normal((64, 32, 32, 3))
        y = tf.random.uniform((64,), maxval=10, dtype=tf.int32)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(jit_compile=jit)
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            return loss, tape.gradient(loss, model.trainable_variables)

        (loss, grads), peak = run_with_peak(step, warm=True)
        return loss, grads, peak
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_lean_gelu_and_layer_norm_equal_keras(x_dtype):
    from kvram.layers.lean import LeanLayerNormalization, lean_gelu

    x = tf.cast(tf.random.normal((4, 7, 32), seed=1) * 3, x_dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, theirs = lean_gelu(x), keras.activations.gelu(x)
    tol = 1e-6 if x_dtype == "float32" else 1e-2  # bf16's epsilon 7.8e-3
    if x_dtype == "float32":
        np.testing.assert_array_equal(values(ours), values(theirs))
    else:  # computed in float32 and rounded once (PyTorch's formula): the true GELU, rounded
        x64, ours64, theirs64 = (tf.cast(t, tf.float64).numpy() for t in (x, ours, theirs))
        truth = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
        error = np.abs(ours64 - truth)
        # below x = -5.4, 1 + erf(x / sqrt(2)) is 0 in float32 (as in PyTorch): an error under 1e-6
        assert np.all(error <= 2.0**-8 * np.abs(truth) + 1e-6), error.max()
        assert error.max() <= np.abs(theirs64 - truth).max()
        assert max_rel_diff([tf.cast(theirs, tf.float32)], [tf.cast(ours, tf.float32)]) <= tol
    assert max_rel_diff([tape.gradient(theirs, x)], [tape.gradient(ours, x)]) <= tol

    keras.mixed_precision.set_global_policy("mixed_bfloat16" if x_dtype == "bfloat16" else "float32")
    try:
        norm = keras.layers.LayerNormalization(epsilon=1e-6)
        norm.build(x.shape)
        norm.gamma.assign(tf.random.normal((32,), 1.0, 0.3, seed=2))
        norm.beta.assign(tf.random.normal((32,), 0.0, 0.3, seed=3))
        lean = LeanLayerNormalization.from_config(norm.get_config())
        lean.build(x.shape)
        lean.set_weights(norm.get_weights())
        results = []
        for layer in (norm, lean):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x)
                loss = tf.reduce_sum(tf.cast(out, tf.float32) * tf.range(32, dtype=tf.float32))
            results.append((out, tape.gradient(loss, [x, *layer.trainable_variables])))
        (a, ga), (b, gb) = results
        assert b.dtype == a.dtype
        assert max_rel_diff([tf.cast(a, tf.float32)], [tf.cast(b, tf.float32)]) <= tol
        assert max_rel_diff(ga, gb) <= (1e-5 if x_dtype == "float32" else 1e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_lean_activations_keep_a_vit_step_and_lower_its_peak():
    plain_loss, plain_grads, plain_peak = _vit_tiny_step(lean=False)
    lean_loss, lean_grads, lean_peak = _vit_tiny_step(lean=True)
    print(f"vit_tiny step peak: plain {plain_peak / 2**20:.1f} MiB, lean {lean_peak / 2**20:.1f} MiB")
    assert float(lean_loss) == pytest.approx(float(plain_loss), rel=1e-6)
    assert max_rel_diff(plain_grads, lean_grads, per_tensor=False) <= 1e-5
    # each block keeps its GELU's input alone, and its norms' inputs without float32 copies
    assert lean_peak <= 0.85 * plain_peak, (plain_peak, lean_peak)


def test_lean_activations_rejects_non_layers_and_leaves_other_activations():
    with pytest.raises(TypeError, match="lean_activations expects a Keras model or layer. Received: model=3"):
        kvram.speed.lean_activations(3)
    model = keras.Sequential([keras.Input((5, 4)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.LayerNormalization(axis=1)])
    x = tf.random.normal((3, 5, 4))
    before = values(model(x, training=True))
    # the norm's class (over axis 1 it runs Keras's own computation); the relu stays
    assert kvram.speed.lean_activations(model) == 1
    assert model.layers[0].activation is keras.activations.relu
    np.testing.assert_array_equal(values(model(x, training=True)), before)


def test_import_pins_host_memory_where_a_gpu_is_seen_unless_told_not_to():
    from kvram import speed

    gpu = ["PhysicalDevice(GPU:0)"]
    assert speed.pins_by_default(environ={}, gpus=gpu, started=False)
    assert speed.pins_by_default(environ={speed.PIN_ENV: "1"}, gpus=gpu, started=False)
    assert not speed.pins_by_default(environ={speed.PIN_ENV: "0"}, gpus=gpu, started=False)
    assert not speed.pins_by_default(environ={}, gpus=[], started=False)  # nothing to pin for
    assert not speed.pins_by_default(environ={}, gpus=gpu, started=True)  # too late, and no error
    # This process: TensorFlow sees no GPU here (a GPU machine runs tests/test_speed.py's gpu tests).
    if not tf.config.list_physical_devices("GPU"):
        assert not speed.host_memory_pinned()


def _gpt2(dropout):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=128,
        dropout=dropout, max_sequence_length=256,
    )
    return keras.Model(backbone.input, keras.layers.Dense(256, name="lm_head")(backbone.output))


def _gpt2_batch():
    rng = np.random.default_rng(0)
    mask = np.ones((4, 256), "int32")
    mask[:, -40:] = 0  # a padded tail: a padding mask merged with the causal one
    x = {"token_ids": tf.constant(rng.integers(1, 256, (4, 256)), tf.int32), "padding_mask": tf.constant(mask)}
    return x, tf.constant(rng.integers(0, 256, (4, 256)), tf.int32)


def _gpt2_step(model, x, y):
    from tests.helpers import run_with_peak

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        return logits, [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    (logits, grads), peak = run_with_peak(step, warm=True)
    return logits, grads, peak


def test_efficient_attention_keeps_a_kerashub_decoder_step_and_lowers_its_peak():
    """KerasHub's GPT-2 attention (`CachedMultiHeadAttention`, a subclass of
    Keras's, given a causal mask merged with a padding mask): same logits and
    gradients, without the n x n scores and probabilities at the step's peak."""
    with tf.device("/CPU:0"):  # the allocator whose peak is read, on a machine with a GPU too
        x, y = _gpt2_batch()
        model = _gpt2(dropout=0.0)
        plain_logits, plain_grads, plain_peak = _gpt2_step(model, x, y)
        assert kvram.speed.efficient_attention(model, chunk_size=96) == 2
        assert model.train_function is None
        logits, grads, peak = _gpt2_step(model, x, y)
    print(f"GPT-2 step peak: plain {plain_peak / 2**20:.1f} MiB, efficient attention {peak / 2**20:.1f} MiB")
    assert max_rel_diff([plain_logits], [logits]) <= 1e-5
    assert max_rel_diff(plain_grads, grads, per_tensor=False) <= 1e-5
    assert peak <= 0.8 * plain_peak, (plain_peak, peak)


def test_efficient_attention_drops_attention_probabilities_while_training():
    x, _ = _gpt2_batch()
    model = _gpt2(dropout=0.1)
    kvram.speed.efficient_attention(model)
    inference = values(model(x, training=False))
    first, second = values(model(x, training=True)), values(model(x, training=True))
    assert np.all(np.isfinite(first))
    assert not np.allclose(first, inference) and not np.allclose(first, second)
    np.testing.assert_array_equal(values(model(x, training=False)), inference)


def test_efficient_attention_with_keras_causal_mask_equals_keras():
    keras.utils.set_random_seed(1)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    q = tf.random.normal((3, 50, 16), seed=4)
    expected = values(layer(q, q, use_causal_mask=True))
    assert kvram.speed.efficient_attention(layer, chunk_size=16) == 1
    assert max_rel_diff([expected], [values(layer(q, q, use_causal_mask=True))]) <= 1e-5
    assert max_rel_diff([values(keras.layers.MultiHeadAttention.call(layer, q, q))],
                        [values(layer(q, q))]) <= 1e-5


# Every attention_mask shape Keras's MultiHeadAttention takes: (B, T, S), (T, S), one
# broadcast over queries, one per head, one broadcast over the batch.
@pytest.mark.parametrize("shape", [(3, 10, 12), (10, 12), (3, 1, 1, 12), (3, 1, 12), (3, 2, 10, 12), (1, 12),
                                   (1, 1, 10, 12)])
def test_efficient_attention_takes_every_mask_shape_keras_takes(shape):
    keras.utils.set_random_seed(2)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.0)
    q, v = tf.random.normal((3, 10, 16), seed=4), tf.random.normal((3, 12, 16), seed=5)
    mask = tf.constant(np.random.default_rng(0).random(shape) > 0.4)

    def output_and_gradients():
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            out = layer(q, v, attention_mask=mask)
        return [out, *tape.gradient(out, [q, v] + layer.trainable_weights)]

    expected = values(output_and_gradients())
    assert kvram.speed.efficient_attention(layer, chunk_size=5) == 1
    assert max_rel_diff(expected, values(output_and_gradients()), per_tensor=False) <= 1e-5


def test_efficient_attention_refuses_bad_arguments_with_nothing_left_to_switch():
    inputs = keras.Input((12, 16))
    model = keras.Model(inputs, kvram.layers.MemoryEfficientAttention(num_heads=2, key_dim=8)(inputs, inputs))
    with pytest.raises(ValueError, match=r"`chunk_size` must be an int >= 1. Received: chunk_size=0"):
        kvram.speed.efficient_attention(model, chunk_size=0)
    with pytest.raises(ValueError, match=r"implementation must be one of \('auto', 'chunked', 'cudnn'\). "
                                         r"Received: 'flash'"):
        kvram.speed.efficient_attention(model, implementation="flash")
    assert kvram.speed.efficient_attention(model) == 0


def test_efficient_attention_switches_each_layer_once_and_is_not_saved(tmp_path):
    with pytest.raises(TypeError, match="efficient_attention expects a Keras model or layer. Received: model=3"):
        kvram.speed.efficient_attention(3)
    inputs = keras.Input((12, 16))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
    h = kvram.layers.MemoryEfficientAttention(num_heads=2, key_dim=8)(h, h)
    model = keras.Model(inputs, keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h))
    with pytest.raises(ValueError, match="chunk_size"):
        kvram.speed.efficient_attention(model, chunk_size=0)
    with pytest.raises(ValueError, match=r"implementation must be one of .*Received: 'fast'"):
        kvram.speed.efficient_attention(model, implementation="fast")
    assert kvram.speed.efficient_attention(model) == 2  # MemoryEfficientAttention is one already
    assert kvram.speed.efficient_attention(model) == 0
    x = tf.random.normal((2, 12, 16), seed=5)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    assert not any(hasattr(layer, "_kvram_efficient") for layer in loaded.layers)
    assert max_rel_diff([values(model(x))], [values(loaded(x))]) <= 1e-5


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_lean_gelu_approximate_equals_keras(x_dtype):
    from kvram.layers.lean import lean_gelu_approximate

    x = tf.cast(tf.random.normal((4, 7, 32), seed=1) * 3, x_dtype)
    x32 = tf.cast(x, tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, x32])
        ours, theirs = lean_gelu_approximate(x), keras.activations.gelu(x, approximate=True)
        truth = keras.activations.gelu(x32, approximate=True)
    np.testing.assert_array_equal(values(ours), values(theirs))
    ours, theirs, truth = tape.gradient(ours, x), tape.gradient(theirs, x), tape.gradient(truth, x32)
    if x_dtype == "float32":  # a closed form against autodiff's chain: float32 rounding apart
        assert max_rel_diff([theirs], [ours]) <= 1e-5
    else:  # computed in float32 from bf16 inputs: no further from float32 than Keras's bf16 chain
        assert max_rel_diff([truth], [ours]) <= max_rel_diff([truth], [theirs])


def test_lean_activations_reach_kerashub_approximate_gelu_and_keep_a_decoder_step():
    """GPT-2's feedforward GELU (KerasHub's tanh approximation) and its norms:
    the same loss and gradients (1e-5)."""
    with tf.device("/CPU:0"):
        x, y = _gpt2_batch()
        model = _gpt2(dropout=0.0)
        plain_logits, plain_grads, _ = _gpt2_step(model, x, y)
        # two blocks: two norms and a GELU each; the final norm
        assert kvram.speed.lean_activations(model) == 2 * 3 + 1
        from kvram.layers.lean import lean_gelu_approximate

        assert sum(getattr(layer, "activation", None) is lean_gelu_approximate
                   for layer in model._flatten_layers()) == 2
        logits, grads, _ = _gpt2_step(model, x, y)
    assert max_rel_diff([plain_logits], [logits]) <= 1e-5
    assert max_rel_diff(plain_grads, grads, per_tensor=False) <= 1e-5


@pytest.mark.slow  # an XLA compile in a process of its own: 22.6 s on a 2-core VM without AVX-512
def test_attention_dropout_masks_are_drawn_again_in_the_backward_pass_under_xla(request):
    """The drop masks are drawn where they are used: the forward's from a seed
    that depends on the layer's input (from the seed alone, XLA on the CPU drew
    every layer's random numbers at the step's start and held them all: 128.2
    MiB against 32.2 without dropout, eight layers), the backward's from one
    that depends on the incoming gradient (with one chunk XLA unrolls both
    loops; on an H200 it merged the two and kept each layer's forward mask for
    the backward pass, 3.4 GiB in a GPT-2-medium-shaped decoder's step:
    benchmarks/results/decoder_buffers_h200.json)."""
    from kvram.layers.attention import chunked_attention
    from tests.helpers import in_own_process, run_with_peak

    # The CPU allocator's peak, in a process of its own: in the suite's process, tf.data
    # threads that earlier tests left running allocate meanwhile (a full-suite run on a
    # 2-core VM read 18.8 MiB without dropout and 39.2 with, where alone both read 32.2).
    if in_own_process(request):
        return
    b, n, t, h, layers = 2, 4, 512, 16, 8
    x = tf.random.normal((b, n, t, h), seed=1)

    def peak(dropout):
        @tf.function(jit_compile=True)
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = x
                for i in range(layers):  # a stack of attentions, as in a model
                    out = chunked_attention(out, out, out, chunk_size=t, dropout=dropout,
                                            seed=tf.constant([1, i]) if dropout else None)
                loss = tf.reduce_sum(out * out)
            return tape.gradient(loss, x)

        return run_with_peak(step, warm=True)[1]

    draw = b * n * t * t * 4  # one layer's float32 random numbers (8 MiB)
    without, with_dropout = peak(0.0), peak(0.1)
    print(f"peak without dropout {without / 2**20:.1f} MiB, with {with_dropout / 2**20:.1f} MiB")
    # a layer's draws in flight (the forward's or the backward's), not one held
    # for every layer (96 MiB over the peak without dropout before the change)
    assert with_dropout < without + 2 * draw, (without, with_dropout, draw)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_lean_rms_norm_and_silu_equal_kerashubs_llama(policy):
    """KerasHub's LlamaLayerNorm and its feedforward's float32 SiLU against
    kvram.layers.lean's: the same values, gradients within float rounding."""
    from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm

    from kvram.layers.lean import lean_silu, make_lean_rms_norm

    keras.mixed_precision.set_global_policy(policy)
    try:
        x = tf.cast(tf.random.normal((4, 7, 32), seed=1) * 3, keras.mixed_precision.global_policy().compute_dtype)
        plain, lean = LlamaLayerNorm(epsilon=1e-5), LlamaLayerNorm(epsilon=1e-5)
        scale = np.random.default_rng(2).normal(1.0, 0.3, 32).astype("float32")
        for layer in (plain, lean):
            layer.build(x.shape)
            layer.scale.assign(scale)
        make_lean_rms_norm(lean)
        weights = tf.range(32, dtype=tf.float32)
        results = []
        for layer in (plain, lean):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x)
                loss = tf.reduce_sum(tf.cast(out, tf.float32) * weights)
            results.append((out, tape.gradient(loss, [x, layer.scale])))
        (a, ga), (b, gb) = results
        assert b.dtype == a.dtype == x.dtype
        tol = 1e-5 if policy == "float32" else 1e-2  # bf16's epsilon 7.8e-3
        assert max_rel_diff([tf.cast(a, tf.float32)], [tf.cast(b, tf.float32)]) <= (1e-6 if policy == "float32" else tol)
        assert max_rel_diff(ga, gb) <= tol
        assert {**lean.get_config(), "name": ""} == {**plain.get_config(), "name": ""}
        assert type(lean) is LlamaLayerNorm

        def keras_hubs_silu(x):  # llama_decoder.py: cast to float32, SiLU, cast back
            return tf.cast(keras.activations.silu(tf.cast(x, tf.float32)), x.dtype)

        x32 = tf.cast(x, tf.float32)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([x, x32])
            ours, theirs, truth = lean_silu(x), keras_hubs_silu(x), keras.activations.silu(x32)
        np.testing.assert_array_equal(values(ours), values(theirs))
        ours, theirs, truth = tape.gradient(ours, x), tape.gradient(theirs, x), tape.gradient(truth, x32)
        if policy == "float32":
            assert max_rel_diff([theirs], [ours]) <= 1e-5
        else:  # no further from the float32 gradient than KerasHub's bf16 chain
            assert max_rel_diff([truth], [ours]) <= max_rel_diff([truth], [theirs])
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_outside_xla_in_a_step_of_compiled_parts_the_lean_norms_compile_themselves(norm):
    """Traced outside XLA within `compiled_blocks()` (host_offload's step: a decoder's final norm
    runs between its compiled blocks and its head), a lean norm's forward and backward passes are
    XLA computations of their own: the step's graph holds no TensorFlow op with a float32 result of
    the input's shape (it held 15 for the RMS norm, 20 for LayerNormalization; Llama-3-8B's final
    norm at 65,536 tokens cast a 1 GiB float32 copy there and ran a 24 GiB GPU out of memory), and
    the values are those the norm computes elsewhere (a bfloat16 rounding)."""
    from kvram.layers import _compiling
    from kvram.layers.lean import lean_layer_norm, lean_rms_norm

    rows, d = 64, 32
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((rows, d)), tf.bfloat16)
    dy = tf.constant(rng.standard_normal((rows, d)), tf.bfloat16)
    scale = tf.constant(rng.normal(1.0, 0.3, d), tf.float32)
    beta = tf.constant(rng.normal(0.0, 0.3, d), tf.float32)

    def step():
        with tf.GradientTape() as tape:
            tape.watch([x, scale])
            if norm == "rms":
                y = lean_rms_norm(x, scale, 1e-5, tf.bfloat16)
            else:
                y = lean_layer_norm(x, scale, beta, 1e-5)
        return [y] + tape.gradient(y, [x, scale], output_gradients=dy)

    with _compiling.compiled_blocks():
        function = tf.function(step)
        graph = function.get_concrete_function().graph
        compiled = function()
    large = [op.name for op in graph.get_operations() for t in op.outputs
             if t.dtype == tf.float32 and t.shape.as_list() == [rows, d]]
    assert large == []
    calls = [op for op in graph.get_operations() if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert len(calls) == 2 and all(op.get_attr("_XlaMustCompile") for op in calls)
    plain = tf.function(step)()
    assert [t.dtype for t in compiled] == [t.dtype for t in plain]
    for a, b in zip(compiled, plain):
        np.testing.assert_allclose(tf.cast(a, tf.float32).numpy(), tf.cast(b, tf.float32).numpy(), rtol=2e-2, atol=2e-2)


def _llama(policy="float32"):
    import keras_hub

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=256, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=64, intermediate_dim=256,
                                              tie_word_embeddings=True)
    return keras.Model(backbone.input, keras.layers.Dense(256, name="lm_head")(backbone.output))


def test_lean_activations_reach_kerashub_llama_and_keep_its_step():
    """Llama's RMS norms (two a block and the final one) and SwiGLU gates (one a
    block): the same logits and gradients (1e-5, float32)."""
    from kvram.layers.lean import lean_silu

    with tf.device("/CPU:0"):
        x, y = _gpt2_batch()
        model = _llama()
        plain_logits, plain_grads, _ = _gpt2_step(model, x, y)
        assert kvram.speed.lean_activations(model) == 2 * 3 + 1
        assert kvram.speed.lean_activations(model) == 0  # done already
        gates = [layer._feedforward_gate_dense for layer in model._flatten_layers()
                 if type(layer).__name__ == "LlamaTransformerDecoder"]
        assert len(gates) == 2 and all(gate.activation is lean_silu for gate in gates)
        logits, grads, _ = _gpt2_step(model, x, y)
    assert max_rel_diff([plain_logits], [logits]) <= 1e-5
    assert max_rel_diff(plain_grads, grads, per_tensor=False) <= 1e-5


def _kept_for_the_backward(model, x, y) -> dict:
    """{dtype: bytes} of the forward tensors that the traced training step's
    backward ops read (graph mode: the executor holds each until its last
    reader ran, so these are what the step keeps from its forward pass)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    backward = lambda op: op.name.startswith("gradient_tape/")  # noqa: E731
    kept = {}
    for op in step.get_concrete_function().graph.get_operations():
        for t in () if backward(op) else op.outputs:
            if t.dtype.is_floating and any(backward(c) for c in t.consumers()):
                assert t.shape.is_fully_defined(), t
                kept[t.dtype.name] = kept.get(t.dtype.name, 0) + t.shape.num_elements() * t.dtype.size
    return kept


def test_lean_activations_keep_no_float32_copies_in_a_bfloat16_llama_step():
    """Under mixed_bfloat16, the float32 copies of the RMS norms' inputs and
    outputs and of the SwiGLU gates are no longer kept for the backward pass:
    the float32 bytes kept drop by at least the gates' (B x T x intermediate x
    4 bytes a block), and the bytes kept in all drop."""
    try:
        x, y = _gpt2_batch()
        model = _llama("mixed_bfloat16")
        plain = _kept_for_the_backward(model, x, y)
        kvram.speed.lean_activations(model)
        lean = _kept_for_the_backward(model, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print(f"kept for the backward (MiB): plain {({k: v / 2**20 for k, v in plain.items()})}, "
          f"lean {({k: v / 2**20 for k, v in lean.items()})}")
    gates = 2 * 4 * 256 * 256 * 4  # two blocks' float32 gates, batch 4 x 256, intermediate 256
    assert lean["float32"] <= plain["float32"] - gates
    assert sum(lean.values()) < sum(plain.values())
