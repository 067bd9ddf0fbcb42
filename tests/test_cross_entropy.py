"""kvram.speed.fused_cross_entropy: the head and its loss in chunks, equal to Keras's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.layers._cross_entropy import linear_cross_entropy
from tests.helpers import max_rel_diff


def keras_reference(hidden, kernel, labels, weights, bias=None, transposed=False):
    logits = tf.matmul(hidden, kernel, transpose_b=transposed)
    if bias is not None:
        logits = logits + bias
    values = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return tf.reduce_sum(values * weights)


@pytest.mark.parametrize("transposed,with_bias,chunk", [(False, True, 4), (True, False, 5), (False, False, 64)])
def test_linear_cross_entropy_equals_keras_in_float32(transposed, with_bias, chunk):
    """Values and gradients (hidden, kernel, bias) within 1e-5 in float32, with
    padding weights, for a chunk that divides the rows, one that does not and
    one larger than them."""
    rng = np.random.default_rng(0)
    hidden = tf.constant(rng.standard_normal((3, 7, 16)), tf.float32)
    kernel = tf.Variable(rng.standard_normal((40, 16) if transposed else (16, 40)) * 0.3, dtype=tf.float32)
    bias = tf.Variable(rng.standard_normal(40) * 0.1, dtype=tf.float32) if with_bias else None
    labels = tf.constant(rng.integers(0, 40, (3, 7)), tf.int32)
    weights = np.ones((3, 7), np.float32)
    weights[1, :3] = 0  # padding
    weights[2, 5:] = 0
    sources = [hidden, kernel] + ([bias] if with_bias else [])

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch(hidden)
            value = fn()
        return [value] + tape.gradient(value, sources)

    theirs = grads(lambda: keras_reference(hidden, kernel, labels, weights, bias, transposed))
    ours = grads(lambda: linear_cross_entropy(hidden, kernel, labels, weights, bias=bias, transposed=transposed,
                                              chunk_size=chunk))
    assert max_rel_diff(theirs, ours) < 1e-5
    jitted = tf.function(lambda: grads(lambda: linear_cross_entropy(
        hidden, kernel, labels, weights, bias=bias, transposed=transposed, chunk_size=chunk)), jit_compile=True)()
    assert max_rel_diff(theirs, jitted) < 1e-5


@pytest.mark.parametrize("transposed,with_bias", [(False, True), (True, False)])
def test_in_a_step_whose_blocks_compile_alone_the_loop_and_backward_pass_are_xla_computations(transposed, with_bias):
    """Within `compiled_blocks()` (host_offload's step, in TensorFlow's executor), the chunk loop and
    the backward pass are XLA computations of their own, called from the step's graph, so that
    the products take the kernel in its own dtype (as TensorFlow ops they ran on a float32 copy of
    it: Llama-3-8B's head ran a 24 GiB GPU out of memory there); values and gradients equal the
    same call outside it within 1e-5 (float32)."""
    from kvram.layers import _compiling

    rng = np.random.default_rng(1)
    hidden = tf.Variable(rng.standard_normal((2, 9, 16)), dtype=tf.float32)
    kernel = tf.Variable(rng.standard_normal((40, 16) if transposed else (16, 40)) * 0.3, dtype=tf.float32)
    bias = tf.Variable(rng.standard_normal(40) * 0.1, dtype=tf.float32) if with_bias else None
    labels = tf.constant(rng.integers(0, 40, (2, 9)), tf.int32)
    sources = [hidden, kernel] + ([bias] if with_bias else [])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            value = linear_cross_entropy(hidden, kernel, labels, bias=bias, transposed=transposed, chunk_size=4) * 3.0
        return [value] + tape.gradient(value, sources)

    def compiled_calls(graph):
        return [n for n in graph.as_graph_def().node
                if n.op in ("PartitionedCall", "StatefulPartitionedCall") and n.attr["_XlaMustCompile"].b]

    plain = step()
    assert compiled_calls(step.get_concrete_function().graph) == []
    with _compiling.compiled_blocks():
        alone = tf.function(step.python_function)
        graph = alone.get_concrete_function().graph
        values = alone()
    called = compiled_calls(graph)
    assert len(called) == 2, [n.name for n in called]  # the loop, the backward pass
    assert max_rel_diff(plain, values) < 1e-5


@pytest.mark.parametrize("alone", [False, True])
def test_under_xla_the_kernels_gradient_is_made_without_a_float32_copy_of_its_shape(alone):
    """Under XLA (the whole step, or the loop and the backward pass alone as in host_offload's step)
    the kernel's gradient is made in the backward pass a slice of the vocabulary at a time, written
    into one tensor of the kernel's shape: the peak above the inputs stays under two kernels' worth
    of float32 (measured 1.28 at 512 x 4096, 64 rows, 16-row chunks; the forward pass's running
    (D, V) float32 sum, then its scaled copy, peaked at 3.0), and gradients equal Keras's (1e-5)."""
    from kvram.layers import _compiling

    rng = np.random.default_rng(0)
    d, v, rows = 512, 4096, 64
    hidden = tf.Variable(rng.standard_normal((rows, d)), dtype=tf.float32)
    kernel = tf.Variable(rng.standard_normal((d, v)) * 0.05, dtype=tf.float32)
    labels = tf.constant(rng.integers(0, v, rows), tf.int32)

    def step(fused):
        with tf.GradientTape() as tape:
            if fused:
                value = linear_cross_entropy(hidden, kernel, labels, chunk_size=16)
            else:
                value = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(
                    labels, tf.matmul(hidden, kernel), from_logits=True))
        return [value] + tape.gradient(value, [hidden, kernel])

    if alone:
        with _compiling.compiled_blocks():
            fused = tf.function(lambda: step(True))
            fused()
    else:
        fused = tf.function(lambda: step(True), jit_compile=True)
        fused()
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    values = fused()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    assert peak < 2 * d * v * 4, peak / (d * v * 4)
    assert max_rel_diff(step(False), values) < 1e-5


@pytest.mark.slow  # XLA compiles
def test_bfloat16_products_under_a_persistent_tape_in_xla():
    """A persistent tape (kvram.Model's update_in_backward with the guard
    keeps one) in an XLA-compiled function with bfloat16 weights: the loop is
    not recorded, its gradient is the custom one, the same as a plain tape's
    (a recorded loop failed here: its products' float32 gradients met the
    casts' bfloat16 ones)."""
    rng = np.random.default_rng(0)
    hidden = tf.Variable(rng.standard_normal((64, 16)), dtype=tf.bfloat16)
    kernel = tf.Variable(rng.standard_normal((16, 50)) * 0.3, dtype=tf.bfloat16)
    labels = tf.constant(np.arange(64) % 50)

    def grads(persistent):
        @tf.function(jit_compile=True)
        def step():
            with tf.GradientTape(persistent=persistent) as tape:
                value = linear_cross_entropy(hidden, kernel, labels, chunk_size=16, dtype=tf.bfloat16)
            return [value] + tape.gradient(value, [hidden, kernel])

        return step()

    plain, persistent = grads(False), grads(True)
    assert [g.dtype for g in persistent[1:]] == [tf.bfloat16, tf.bfloat16]
    assert max_rel_diff(plain, persistent) == 0


def small_causal_lm(kind):
    import keras_hub

    keras.utils.set_random_seed(0)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=48, num_layers=1, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=12, dropout=0.0)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=48, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
                                              tie_word_embeddings=False)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def batch():
    rng = np.random.default_rng(1)
    padding = np.ones((4, 10), "int32")
    padding[1, 7:] = 0
    x = {"token_ids": rng.integers(0, 48, (4, 10)).astype("int32"), "padding_mask": padding}
    y = rng.integers(0, 48, (4, 10)).astype("int32")
    return x, y, padding.astype("float32")


def loss_and_gradients(model, x, y, weight, fused):
    x = {k: tf.constant(v) for k, v in x.items()}
    with tf.GradientTape() as tape:
        if fused:
            loss = model._kvram_fused_head.loss(x, tf.constant(y), tf.constant(weight))
        else:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True), sample_weight=weight)
    return [loss] + [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_weights)]


@pytest.mark.slow  # KerasHub models, several seconds each on 2 cores
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
def test_kerashub_causal_lms_fused_loss_equals_keras(kind, reduction):
    """A small KerasHub GPT2CausalLM (tied ReversibleEmbedding head) and
    LlamaCausalLM (untied): the fused loss and every gradient equal Keras's
    compute_loss within 1e-5 in float32, padding tokens weighted 0."""
    model = small_causal_lm(kind)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
                  optimizer="sgd")
    x, y, weight = batch()
    theirs = loss_and_gradients(model, x, y, weight, fused=False)
    with pytest.warns(UserWarning, match="log the loss alone"):  # CausalLM's SparseCategoricalAccuracy
        assert kvram.speed.fused_cross_entropy(model, chunk_size=7) == 1
    assert model._kvram_fused_head.transposed == (kind == "gpt2")
    ours = loss_and_gradients(model, x, y, weight, fused=True)
    # The attention's key bias has an analytically zero gradient (softmax is
    # shift-invariant per row): it is compared against the overall scale.
    assert max_rel_diff(theirs, ours, per_tensor=False) < 1e-5
    zero = [i for i, g in enumerate(theirs) if float(tf.reduce_max(tf.abs(g))) < 1e-9]
    assert max_rel_diff([g for i, g in enumerate(theirs) if i not in zero],
                        [g for i, g in enumerate(ours) if i not in zero]) < 1e-5
    assert len(zero) <= 1


@pytest.mark.slow  # two fit() runs each
@pytest.mark.parametrize("cls", ["keras", "kvram"])
def test_fit_with_the_fused_loss_trains_as_keras_does(cls):
    """A functional model ending in Dense(vocabulary) (a keras.Model and a
    kvram.Model): two fit() epochs with the fused loss end at Keras's weights
    within 1e-5 (float32, SGD), the logged loss equal too; predict still
    returns the logits."""
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((10,), dtype="int32")
        h = keras.layers.Embedding(48, 16)(inputs)
        h = keras.layers.Dense(16, activation="tanh")(h)
        logits = keras.layers.Dense(48)(h)
        model = (keras.Model if cls == "keras" else kvram.Model)(inputs, logits)
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x = rng.integers(0, 48, (16, 10)).astype("int32")
    y = np.roll(x, 1, axis=1)
    w = np.ones((16, 10), "float32")
    w[:, :2] = 0
    plain, fused = build(), build()
    kvram.speed.fused_cross_entropy(fused, chunk_size=24)
    a = plain.fit(x, y, sample_weight=w, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
    b = fused.fit(x, y, sample_weight=w, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
    assert np.allclose(a, b, rtol=1e-5) and a[1] < a[0]
    assert max_rel_diff(plain.get_weights(), fused.get_weights()) < 1e-5
    assert fused.predict(x[:2], verbose=0).shape == (2, 10, 48)


def test_fused_cross_entropy_says_what_it_cannot_take():
    """Clear errors: not compiled, another loss, probabilities, ignore_class,
    compiled metrics, a head with an activation, a soft cap, a bad chunk."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(8)(inputs))
    with pytest.raises(ValueError, match="call model.compile"):
        kvram.speed.fused_cross_entropy(model)
    model.compile(loss="mse")
    with pytest.raises(ValueError, match="compiled with loss='mse'"):
        kvram.speed.fused_cross_entropy(model)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy())
    with pytest.raises(ValueError, match="from_logits=True.*Received: from_logits=False"):
        kvram.speed.fused_cross_entropy(model)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    with pytest.raises(ValueError, match="ignore_class=0"):
        kvram.speed.fused_cross_entropy(model)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    with pytest.warns(UserWarning, match="log the loss alone; the compiled metrics are computed by evaluate"):
        kvram.speed.fused_cross_entropy(model)
    softmax = keras.Model(inputs, keras.layers.Dense(8, activation="softmax")(inputs))
    softmax.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="without activation.*'softmax'"):
        kvram.speed.fused_cross_entropy(softmax)
    other = keras.Model(inputs, keras.layers.Activation("linear")(inputs))
    other.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="Received: Activation"):
        kvram.speed.fused_cross_entropy(other)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="chunk_size"):
        kvram.speed.fused_cross_entropy(model, chunk_size=0)
    with pytest.raises(TypeError, match="Keras model"):
        kvram.speed.fused_cross_entropy(keras.layers.Dense(2))

    class Custom(keras.Model):
        def train_step(self, data):
            return {}

    custom = Custom(inputs, keras.layers.Dense(8)(inputs))
    custom.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="Custom overrides it"):
        kvram.speed.fused_cross_entropy(custom)


def test_a_head_in_a_checkpointed_rebuild_is_found():
    """remat.rebuild puts the head in a part of its own: fused_cross_entropy
    finds it there, and the loss equals Keras's."""
    from kvram import remat

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(32, 8)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(32, name="head")(h))
    chain = remat.segments(model)
    rebuilt = remat.rebuild(model, [[i] for i in range(len(chain))], [True] * (len(chain) - 1) + [False])
    rebuilt.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, (4, 6)).astype("int32")
    expected = rebuilt.compute_loss(x=x, y=x, y_pred=rebuilt(x))
    kvram.speed.fused_cross_entropy(rebuilt)
    assert rebuilt._kvram_fused_head.layer.name == "head"
    assert abs(float(rebuilt._kvram_fused_head.loss(tf.constant(x), tf.constant(x), None)) - float(expected)) < 1e-5
