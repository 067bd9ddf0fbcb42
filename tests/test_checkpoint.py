import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.layers import Checkpoint
from tests.helpers import in_own_process, max_rel_diff, one_op_order, run_with_peak

TOL = 1e-5


def make_block(width=16, dropout=0.3, batchnorm=False):
    layers = [keras.layers.Dense(32, activation="gelu"), keras.layers.Dropout(dropout)]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(width))
    block = keras.Sequential(layers)
    block.build((None, width))
    return block


def grads_and_state(layer, block, x, seed_state):
    block.non_trainable_variables[0].assign(seed_state)  # same dropout masks for both runs
    with tf.GradientTape() as tape:
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * y)
    grads = tape.gradient(loss, block.trainable_variables)
    return loss, grads, [tf.identity(v.value) for v in block.non_trainable_variables]


# Under XLA (1-1.5 s each on 2 cores) one of the four is in `pytest -m "not slow"`; the full suite runs all.
@pytest.mark.parametrize("batchnorm, mode, policy", [
    pytest.param(batchnorm, mode, policy,
                 marks=[pytest.mark.slow] if mode == "jit_compile" and (batchnorm or policy != "full") else [])
    for batchnorm in (False, True) for mode in ("eager", "tf.function", "jit_compile")
    for policy in ("full", "save_dots")])
def test_gradients_equal_plain_with_dropout(mode, batchnorm, policy):
    block = make_block(batchnorm=batchnorm)
    wrapped = Checkpoint(block, policy=policy)
    x = tf.random.normal((8, 16))
    seed = tf.identity(block.non_trainable_variables[0].value)

    def run(layer):
        fn = lambda: grads_and_state(layer, block, x, seed)  # noqa: E731
        if mode == "tf.function":
            fn = tf.function(fn)
        elif mode == "jit_compile":
            fn = tf.function(fn, jit_compile=True)
        out = fn()
        if batchnorm:  # restore moving statistics for the next run
            for v in block.non_trainable_variables[1:]:
                v.assign(tf.zeros_like(v) if "mean" in v.path else tf.ones_like(v))
        return out

    plain_loss, plain_grads, plain_state = run(block)
    ckpt_loss, ckpt_grads, ckpt_state = run(wrapped)
    # Dropout is active: the plain loss differs from the inference loss.
    assert float(plain_loss) != pytest.approx(float(tf.reduce_sum(block(x) ** 2)))
    assert float(ckpt_loss) == pytest.approx(float(plain_loss), rel=TOL)
    # With BatchNorm, the first Dense's bias gradient is analytically zero: compare
    # against the model's gradient scale instead of that tensor's own noise.
    assert max_rel_diff(plain_grads, ckpt_grads, per_tensor=not batchnorm) <= TOL
    # Seed state and (with BatchNorm) moving statistics end where the plain run left
    # them: the recomputation replays the forward pass's updates, it does not add to them.
    for a, b in zip(plain_state, ckpt_state):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=TOL, atol=0)


def test_inference_calls_layer_directly():
    block = make_block()
    wrapped = Checkpoint(block)
    x = tf.random.normal((4, 16))
    np.testing.assert_array_equal(wrapped(x, training=False).numpy(), block(x).numpy())
    np.testing.assert_array_equal(wrapped(x).numpy(), block(x).numpy())


def test_rejects_non_layer():
    with pytest.raises(TypeError, match=r"must be a keras.layers.Layer.*Received: layer=.*function"):
        Checkpoint(lambda x: x)
    with pytest.raises(TypeError, match=r"Received: layer=3 of type int"):
        Checkpoint(3)


def test_rejects_double_wrap():
    with pytest.raises(ValueError, match="already a kvram.layers.Checkpoint"):
        Checkpoint(Checkpoint(make_block()))


def test_rejects_unknown_policy():
    with pytest.raises(ValueError, match=r"policy must be one of \('full', 'save_dots'\). Received: policy='dots'"):
        Checkpoint(make_block(), policy="dots")


def test_config_round_trip():
    wrapped = Checkpoint(make_block(), name="ck", policy="save_dots")
    clone = Checkpoint.from_config(wrapped.get_config())
    assert isinstance(clone, Checkpoint) and clone.policy == "save_dots"
    assert isinstance(clone.layer, keras.Sequential)
    assert clone.name == "ck"
    assert [type(l) for l in clone.layer.layers] == [type(l) for l in wrapped.layer.layers]


def _stack(checkpoint, blocks=12, width=128, expansion=8, policy="full"):
    inputs = keras.Input((width,))
    x = inputs
    for i in range(blocks):
        bi = keras.Input((width,))
        h = keras.layers.Dense(width * expansion, activation="gelu")(bi)
        h = keras.layers.Dense(width * expansion, activation="gelu")(h)
        h = keras.layers.Dense(width)(h)
        block = keras.Model(bi, keras.layers.Add()([bi, h]), name=f"b{i}")
        x = (Checkpoint(block, policy=policy) if checkpoint else block)(x)
    return keras.Model(inputs, x)


def _step_peak(checkpoint, policy="full", hlo=False, jit=False):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    with tf.device("CPU:0"):
        model = _stack(checkpoint, policy=policy)
        x = tf.random.normal((2048, 128))

        @tf.function(jit_compile=hlo or jit)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x, training=True) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            for v, g in zip(model.trainable_variables, grads):
                v.assign_sub(1e-4 * g)
            return loss

        if hlo:
            return step.experimental_get_compiler_ir()(stage="optimized_hlo")
        return run_with_peak(step)[1]


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_peak_memory_of_checkpointed_stack(jit, request):
    """The same bars in TensorFlow's graph executor and under XLA (which
    ignores control dependencies and merges equal expressions: save_dots
    peaked as high as no checkpointing there, 786.5 against 793.5 MiB, until
    its kept products' replay read a data dependency, `_order.after`)."""
    if in_own_process(request):  # the allocator's peaks, in a process of its own
        return
    plain = _step_peak(checkpoint=False, jit=jit)
    ckpt = _step_peak(checkpoint=True, jit=jit)
    dots = _step_peak(checkpoint=True, policy="save_dots", jit=jit)
    print(f"peak step memory (jit={jit}): plain {plain / 2**20:.1f} MiB, checkpointed {ckpt / 2**20:.1f} MiB, "
          f"save_dots {dots / 2**20:.1f} MiB")
    assert ckpt <= 0.35 * plain, (plain, ckpt)
    # save_dots keeps each block's three products (1024 + 1024 + 128 a row),
    # not the GELUs' inputs and outputs beside them
    assert ckpt < dots <= 0.6 * plain, (plain, ckpt, dots)


@pytest.mark.slow
@pytest.mark.own_process
def test_save_dots_recomputes_no_product_under_xla(request):
    """In XLA's optimised step, save_dots has as many dot products as the
    plain step (the products in the gradients' replay are dead and removed);
    the full policy recomputes each block's first two (the third's value is
    needed by no gradient: XLA removes its recomputation too)."""
    if in_own_process(request):  # run ahead, beside the suite (tests/helpers.py)
        return
    count = {
        name: _step_peak(checkpoint=name != "plain", policy=name if name != "plain" else "full", hlo=True).count(" dot(")
        for name in ("plain", "full", "save_dots")
    }
    print(count)
    assert count["plain"] == 12 * 3 * 3 - 1  # forward, input and kernel gradients; no input gradient of the first
    assert count["save_dots"] == count["plain"]
    assert count["full"] == count["plain"] + 12 * 2


@pytest.mark.slow  # 8.4 s in the fast tier on 2 cores
def test_fit_with_jit_compile_and_predict():
    inputs = keras.Input((16,))
    x = Checkpoint(make_block())(inputs)
    outputs = keras.layers.Dense(1)(x)
    model = kvram.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    data = np.random.rand(64, 16).astype("float32"), np.random.rand(64, 1).astype("float32")
    history = model.fit(*data, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.predict(data[0], verbose=0).shape == (64, 1)
    assert np.isfinite(model.evaluate(*data, verbose=0))


def test_mixed_precision_runs_in_float16():
    kvram.precision.enable("mixed_float16")
    block = make_block()
    wrapped = Checkpoint(block)
    y = wrapped(tf.random.normal((4, 16)), training=True)
    assert y.dtype == tf.float16


def two_in_two_out():
    a, b = keras.Input((8,)), keras.Input((4,))
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    h = keras.layers.Dropout(0.3)(h)
    return keras.Model([a, b], [keras.layers.Dense(3)(h), keras.layers.Dense(2)(h)])


@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_a_block_with_several_inputs_and_outputs(mode):
    """Checkpoint around a functional block of two inputs and two outputs (with
    dropout): the same outputs and gradients as the block itself."""
    rng = np.random.default_rng(0)
    xs = [rng.random((5, 8), dtype="float32"), rng.random((5, 4), dtype="float32")]
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(1)
        a, b = keras.Input((8,)), keras.Input((4,))
        block = two_in_two_out()
        first, second = (Checkpoint(block) if wrap else block)([a, b])
        model = keras.Model([a, b], [first, second])

        def step():
            with tf.GradientTape() as tape:
                outputs = model(xs, training=True)
                loss = sum(tf.reduce_sum(o * o) for o in outputs)
            return outputs, tape.gradient(loss, model.trainable_weights)

        keras.utils.set_random_seed(7)  # the same dropout masks for both
        outputs, grads = (tf.function(step) if mode == "tf.function" else step)()
        assert len(outputs) == 2 and all(g is not None for g in grads)
        results.append([o.numpy() for o in outputs] + [g.numpy() for g in grads])
    for plain, checkpointed in zip(*results):
        assert max_rel_diff(checkpointed, plain) < TOL


@pytest.mark.parametrize(
    "activation, loss, classes",
    [
        ("softmax", keras.losses.sparse_categorical_crossentropy, 10),
        ("sigmoid", keras.losses.binary_crossentropy, 1),
    ],
)
def test_a_checkpointed_classifier_trains_on_the_logits(activation, loss, classes):
    # Keras's cross-entropies read the logits that softmax and sigmoid hang on
    # their output; a Checkpoint's output must carry them, or the loss falls back
    # to clipped probabilities and, where one saturates, to another gradient
    # (EfficientNetB0 with its classifier checkpointed: gradients 0.34 apart).
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(classes, activation=activation)
    head.build((None, 8))
    head.kernel.assign(head.kernel * 200.0)  # saturated: probabilities below the clip's epsilon
    wrapped = Checkpoint(head)
    x = tf.constant(np.random.default_rng(0).standard_normal((16, 8)).astype("float32"))
    y = tf.constant(np.arange(16) % 10 if classes > 1 else (np.arange(16) % 2).reshape(16, 1).astype("float32"))

    @tf.function
    def gradients(layer):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss(y, layer(x, training=True)))
        return [value] + tape.gradient(value, head.trainable_variables)

    plain, checkpointed = gradients(head), gradients(wrapped)
    assert max_rel_diff(plain, checkpointed) < 1e-5
    assert float(plain[0]) > 1.0  # saturated: the clipped form would differ


def _transformer_block(width=32, heads=4):
    inputs = keras.Input((16, width))
    x = keras.layers.LayerNormalization()(inputs)
    x = keras.layers.Add()([inputs, keras.layers.MultiHeadAttention(heads, width // heads, dropout=0.1)(x, x)])
    y = keras.layers.LayerNormalization()(x)
    y = keras.layers.Dense(4 * width, activation="gelu")(y)
    y = keras.layers.Dropout(0.1)(keras.layers.Dense(width)(y))
    return keras.Model(inputs, keras.layers.Add()([x, y]))


@pytest.mark.parametrize("policy_name", ["float32", "mixed_bfloat16"])
def test_save_dots_on_a_transformer_block_equals_plain(policy_name):
    """MultiHeadAttention's EinsumDense projections and the MLP's Dense kept,
    the rest recomputed: loss and gradients as without checkpointing (the
    dropout masks replayed), in float32 and under mixed precision."""
    keras.mixed_precision.set_global_policy(policy_name)
    try:
        keras.utils.set_random_seed(0)
        block = _transformer_block()
        wrapped = Checkpoint(block, policy="save_dots")
        x = tf.random.normal((4, 16, 32))
        seeds = [tf.identity(v.value) for v in block.non_trainable_variables]

        @tf.function
        def run(layer):
            for v, s in zip(block.non_trainable_variables, seeds):
                v.assign(s)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(layer(x, training=True), "float32") ** 2)
            return loss, tape.gradient(loss, block.trainable_variables)

        dots = sum(type(l) in (keras.layers.Dense, keras.layers.EinsumDense) for l in block._flatten_layers())
        assert dots == 6  # query, key, value, output; the MLP's two
        plain_loss, plain_grads = run(block)
        ours_loss, ours_grads = run(wrapped)
        # the forward pass is the same computation: the loss is bit-identical
        assert float(ours_loss) == float(plain_loss)
        # bfloat16 gradients add up in another order (the three projections'
        # input gradients): 1.4e-3 apart measured, within bf16's 7.8e-3 epsilon
        assert max_rel_diff(plain_grads, ours_grads) <= (TOL if policy_name == "float32" else 1e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("base", ["lora", pytest.param("int8", marks=pytest.mark.slow)])  # XLA compiles
def test_under_xla_what_a_block_derives_from_its_weights_is_recomputed_not_held(base):
    """A LoRA layer's merged kernel and an int8 kernel dequantized depend on weights alone:
    XLA merged the recomputation's copy with the forward pass's and held every block's from
    the forward pass to the backward (+8.1 MiB of temporaries a block of two 1024-wide LoRA
    Dense layers, 4 bytes a frozen parameter). Read after the block's inputs, they are
    computed again in the backward pass."""
    from kvram.remat import _check

    width = 256
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        def temporaries(blocks):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((width,))
            h = inputs
            for _ in range(blocks):
                block = keras.Sequential([keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width)])
                block.build((None, width))
                if base == "int8":
                    block.quantize("int8")
                for layer in block.layers:
                    layer.enable_lora(4)
                h = kvram.layers.Checkpoint(block)(h)
            model = keras.Model(inputs, keras.layers.Dense(10, dtype="float32")(h))
            x, y = tf.ones((32, width)), tf.zeros((32,), tf.int32)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            step = _check._training_step(model, x, y, lambda t, p: loss(t, p), True)
            return _check._assignment(step, x, y)["temp"]

        grown = temporaries(6) - temporaries(2)
    finally:
        keras.config.set_dtype_policy("float32")
    held = 4 * 2 * width * width * 4  # 4 more blocks' merged kernels in float32: 2 MiB
    assert grown < held / 8, (grown, held)


def _graph_step_peak(layer, x, y):
    """The peak CPU allocation of a graph-mode (not XLA) step taking the squared error's
    gradients with respect to `layer`'s trainable weights, after one warm-up call."""
    variables = layer.trainable_variables

    @tf.function(jit_compile=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((layer(x, training=True) - y) ** 2)
        return tape.gradient(loss, variables)

    return run_with_peak(step, x, y, warm=True)[1]


def test_outside_xla_a_block_reads_its_weights_without_copying_them():
    """Read after its inputs (as under XLA), a frozen 16 MiB kernel was copied whole in a
    graph-mode step, as `remat.plan` measures in (a Gemma-2B's 2 GB tied embedding there):
    outside XLA a block reads them under a control dependency, which copies nothing."""
    keras.utils.set_random_seed(0)
    n = 2048
    frozen = keras.layers.Dense(n, use_bias=False)
    frozen.build((None, n))
    frozen.trainable = False
    wrapped = Checkpoint(keras.Sequential([frozen, keras.layers.Dense(8)]))
    x, y = tf.random.normal((2, n)), tf.random.normal((2, 8))
    wrapped(x)
    peak = _graph_step_peak(wrapped, x, y)
    kernel = n * n * 4
    assert peak < kernel / 4, (peak, kernel)


@pytest.mark.parametrize("base", ["lora", "int8"])
def test_outside_xla_what_a_block_derives_from_its_weights_is_computed_in_its_turn(base):
    """TensorFlow's executor runs an op once its inputs exist: a recomputation's merged LoRA
    kernel (or dequantized int8 kernel) needs only weights, so it ran at the step's start and
    was held to the backward pass (125.0 -> 260.0 MiB from 2 to 4 blocks of 512 x 8192 LoRA
    Dense). Read after the block's inputs, it waits for them. From 2 to 6 blocks here: 32.0
    (LoRA) and 16.5 MiB (int8) read plainly; read after the inputs, 0.0 and 0.0-1.5 MiB (after
    this file's other tests on 2 cores). The growth moves by up to 2 MiB from run to run
    whatever the blocks add (int8 from 2 to 4 blocks: -1.5 to 2.0 MiB), so 4 blocks are added."""
    width, inner = 256, 2048
    few, many = 2, 6

    def peak(blocks):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16, width))
        h = inputs
        for _ in range(blocks):
            block = keras.Sequential([keras.layers.Dense(inner, activation="gelu"), keras.layers.Dense(width)])
            block.build((None, 16, width))
            if base == "int8":
                block.quantize("int8")
            for layer in block.layers:
                layer.enable_lora(4)
            h = Checkpoint(block)(h)
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        x, y = tf.random.normal((4, 16, width)), tf.random.normal((4, 16, 1))
        with one_op_order():
            return _graph_step_peak(model, x, y)

    grown = peak(many) - peak(few)
    held = (many - few) * 2 * width * inner * 4  # the added blocks' float32 kernels, merged or dequantized: 16 MiB
    assert grown < held / 4, (grown, held)


def _output_and_gradients(call, block):
    """x -> [call(x), the gradients of sum(call(x)**2) for x and `block`'s weights]."""
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = call(x)
            loss = tf.reduce_sum(y * y)
        return [y, *tape.gradient(loss, [x, *block.trainable_variables])]

    return run


def _row_block(dropout):
    layers = [keras.Input((5,)), keras.layers.Dense(16, activation="gelu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.3, seed=3))
    return keras.Sequential(layers + [keras.layers.Dense(5)])


@pytest.mark.parametrize("jit", [False, True, None], ids=["graph", "xla", "rows_unknown"])
@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("rows", [8, 12])
def test_row_chunks_run_the_block_slice_by_slice_and_sum_its_gradients(rows, dropout, jit):
    """row_chunks=3 over 8 rows (slices of 3, 3 and 2: the loop's, then a shorter one) or 12 (three
    of 4: the loop's alone), and traced for any number of rows (jit None: the slices written out):
    the block's output and every gradient are those of the block called on each slice in turn (the
    same random numbers: the recomputation replays each slice's), and its state ends where that
    run's does."""
    from kvram._state import mutable_state

    keras.utils.set_random_seed(0)
    block = _row_block(dropout)
    x = tf.constant(np.random.default_rng(0).normal(size=(rows, 5)).astype("float32"))
    state = mutable_state(block)
    before = [tf.identity(v.value) for v in state]
    size = -(-rows // 3)

    def step(call):
        unknown = [tf.TensorSpec((None, 5), tf.float32)] if jit is None else None

        run = tf.function(_output_and_gradients(call, block), jit_compile=bool(jit), input_signature=unknown)
        for variable, value in zip(state, before):
            variable.assign(value)
        return run(x), [v.numpy() for v in state]

    chunked = Checkpoint(block, row_chunks=3)
    ours, our_state = step(lambda x: chunked(x, training=True))
    theirs, their_state = step(lambda x: tf.concat([block(x[i:i + size], training=True)
                                                    for i in range(0, rows, size)], 0))
    assert max_rel_diff(theirs, ours) < 1e-6
    assert all(np.array_equal(a, b) for a, b in zip(our_state, their_state))
    if not dropout:  # rows that do not depend on each other: the whole batch's gradients
        whole, _ = step(lambda x: Checkpoint(block)(x, training=True))
        assert max_rel_diff(whole, ours) < 1e-6


@pytest.mark.slow  # 2-4 s each on 2 cores
@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_row_chunks_hold_a_slice_of_the_blocks_activations(jit):
    """A block whose activations dwarf its weights (4096 rows x 1024 wide, 16 MiB a tensor, 4.5 MiB
    of weights): run in 8 slices, its step peaks at under half of the whole block's."""
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="gelu"),
                              keras.layers.Dense(1024, activation="gelu"), keras.layers.Dense(64)])
    x = tf.constant(np.random.default_rng(0).normal(size=(4096, 64)).astype("float32"))
    peaks = {}
    for chunks in (None, 8):
        wrapped = Checkpoint(block, row_chunks=chunks)

        def make_step(wrapped=wrapped):
            @tf.function(jit_compile=jit)
            def step():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(wrapped(x, training=True))
                return tape.gradient(loss, block.trainable_variables)

            return step

        with one_op_order():  # one trace: the two differ 6-fold (145.2 and 22.0 MiB, 260.5 and 36.5 under XLA)
            peaks[chunks] = run_with_peak(make_step(), warm=True)[1]
    assert peaks[8] < 0.5 * peaks[None], {k: v / 2**20 for k, v in peaks.items()}


@pytest.mark.slow  # XLA compiles each block's passes
@pytest.mark.own_process  # the allocator's peaks, in a process of its own
def test_row_chunked_blocks_compiled_one_by_one_hold_each_blocks_input_once(request):
    """Under kvram.Model(host_offload=True)'s compiled blocks (`compiled_blocks`), a stack of
    row-chunked blocks holds about each block's input per block, as in the graph executor. When the
    block and its slices were one XLA computation, the custom gradient's input came out of it as a
    copy: 12 blocks peaked 6.3 MiB a block above 4 blocks, for 4 MiB inputs (1.6x; 3.9 MiB now)."""
    if in_own_process(request):
        return
    from kvram.layers import _compiling

    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    hidden = keras.layers.Dense(128)(keras.layers.Dense(512, activation="gelu")(inputs))
    block = keras.Model(inputs, keras.layers.Add()([inputs, hidden]))
    x = tf.constant(np.random.default_rng(0).normal(size=(8192, 128)).astype("float32"))  # 4 MiB

    def peak(depth):
        wrapped = [Checkpoint(block, row_chunks=8) for _ in range(depth)]

        @tf.function
        def step():
            with _compiling.compiled_blocks(), tf.GradientTape() as tape:
                h = x
                for layer in wrapped:
                    h = layer(h, training=True)
                loss = tf.reduce_sum(h)
            return tape.gradient(loss, block.trainable_variables)

        return run_with_peak(step, warm=True)[1]

    per_block = (peak(12) - peak(4)) / 8
    assert per_block <= 1.25 * x.numpy().nbytes, per_block / 2**20


@pytest.mark.slow  # XLA compiles each kind of block's passes
def test_blocks_alike_share_their_compiled_passes_and_each_gets_its_own_gradients():
    """Within `compiled_blocks()` (kvram.Model(host_offload=True)'s step), row-chunked blocks alike (the
    same layers made alike, the same shapes; layer names aside) share one compiled forward pass and one
    backward pass, each traced once and called with the block's own weights. A block made otherwise
    (tanh for relu) compiles its own; blocks alike by their configs that reach a tensor made outside
    them (a constant, 2.0 in one and 3.0 in the other) are not shared. The gradients of every weight and of the input
    equal those of the same blocks in TensorFlow's executor (1e-5)."""
    from kvram.layers import _compiling

    class Scale(keras.layers.Layer):
        def __init__(self, factor):
            super().__init__()
            self.factor = factor

        def call(self, t):
            return t * self.factor

        def get_config(self):  # the factor left out: the trace alone finds it
            return {"name": self.name}

    keras.utils.set_random_seed(0)

    def block(activation="relu", *more):
        return Checkpoint(keras.Sequential([keras.layers.Dense(8, activation=activation), keras.layers.Dense(8),
                                            *more]), row_chunks=2)

    blocks = [block(), block(), block(), block("tanh"), block("relu", Scale(tf.constant(2.0))),
              block("relu", Scale(tf.constant(3.0)))]
    x = tf.constant(np.random.default_rng(0).normal(size=(16, 8)).astype("float32"))
    for b in blocks:
        b(x)
    variables = [v for b in blocks for v in b.trainable_variables]

    def step(compiled):
        @tf.function(autograph=False)
        def run():
            with (_compiling.compiled_blocks() if compiled else contextlib.nullcontext()), \
                    tf.GradientTape() as tape:
                tape.watch(x)
                h = x
                for b in blocks:
                    h = b(h, training=True)
                return tape.gradient(tf.reduce_sum(tf.square(h)), [x] + variables)

        return run

    theirs, ours = step(False)(), step(True)
    assert max_rel_diff(theirs, ours()) < 1e-5
    library = ours.get_concrete_function().graph.as_graph_def().library.function
    compiled = [f.signature.name for f in library if f.attr["_XlaMustCompile"].b]
    # one for the three relu blocks, one for the tanh block, one for each block with a constant
    assert [sum(part in name for name in compiled) for part in ("forward_pass", "backward_slices")] == [4, 4], compiled


@pytest.mark.slow  # XLA compiles
def test_blocks_alike_with_dropout_draw_each_its_own_numbers_when_they_share_their_passes(monkeypatch):
    """Blocks alike with Dropout share their compiled passes within `compiled_blocks()`; each still
    draws from its own seed generator's state: outputs, gradients and the states after the step
    equal those of the same blocks compiled one by one (sharing off), bit for bit."""
    from kvram.layers import _compiling

    keras.utils.set_random_seed(0)
    blocks = [Checkpoint(keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dropout(0.3),
                                           keras.layers.Dense(8)]), row_chunks=2) for _ in range(3)]
    x = tf.constant(np.random.default_rng(0).normal(size=(16, 8)).astype("float32"))
    for b in blocks:
        b(x)
    variables = [v for b in blocks for v in b.trainable_variables]
    states = [v for b in blocks for v in b.non_trainable_variables]
    start = [v.numpy() for v in states]

    def run():
        for v, value in zip(states, start):
            v.assign(value)

        @tf.function(autograph=False)
        def step():
            with _compiling.compiled_blocks(), tf.GradientTape() as tape:
                h = x
                for b in blocks:
                    h = b(h, training=True)
                return [h] + tape.gradient(tf.reduce_sum(tf.square(h)), variables)

        return [t.numpy() for t in step()] + [v.numpy() for v in states]

    shared = run()
    monkeypatch.setattr(_compiling, "share_key", lambda *args: None)
    alone = run()
    assert len(states) == 3 and any((a != b).any() for a, b in zip(shared[-3:], start))  # they drew
    for a, b in zip(alone, shared):
        np.testing.assert_array_equal(b, a)


def test_row_chunks_of_rows_known_and_a_length_unknown_when_traced():
    """Rows known, another axis not (sequences of any length): the loop's slices take every value of
    that axis, and the block's outputs and gradients are the slice-by-slice calls'."""
    keras.utils.set_random_seed(0)
    block = keras.Sequential([keras.Input((None, 5)), keras.layers.Dense(8, activation="gelu"), keras.layers.Dense(5)])
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 3, 5)).astype("float32"))

    def step(call):
        return tf.function(_output_and_gradients(call, block), input_signature=[tf.TensorSpec((6, None, 5))])(x)

    chunked = Checkpoint(block, row_chunks=3)
    ours = step(lambda x: chunked(x, training=True))
    theirs = step(lambda x: tf.concat([block(x[i:i + 2], training=True) for i in (0, 2, 4)], 0))
    assert max_rel_diff(theirs, ours) < 1e-6


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_row_chunks_trace_one_slice_however_many_there_are(jit):
    """The equal slices run as one loop: a step over 64 rows traces to as many graph nodes in
    32 slices as in 2. Written out one after another, a 1024-row block of three Dense layers
    traced to 14.6 times as many nodes in 32 slices as in 2, and took 10 times as long to
    compile with XLA on 2 cores."""
    keras.utils.set_random_seed(0)
    block = _row_block(True)
    x = tf.constant(np.random.default_rng(0).normal(size=(64, 5)).astype("float32"))

    def nodes(chunks):
        wrapped = Checkpoint(block, row_chunks=chunks)
        step = tf.function(_output_and_gradients(lambda t: wrapped(t, training=True), block), jit_compile=jit)
        graph = step.get_concrete_function(x).graph.as_graph_def()
        return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)

    assert nodes(32) == nodes(2)


def test_row_chunks_refused_where_they_cannot_hold():
    block = _row_block(False)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match=f"row_chunks must be None or a positive int. Received: row_chunks={bad!r}"):
            Checkpoint(block, row_chunks=bad)
    with pytest.raises(ValueError, match="it takes policy=\"full\". Received: policy='save_dots', row_chunks=2"):
        Checkpoint(block, policy="save_dots", row_chunks=2)
    normalised = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name="bn")])
    with pytest.raises(ValueError, match=r"BatchNormalization normalises over the rows \(bn\)"):
        Checkpoint(normalised, row_chunks=2)
    Checkpoint(normalised, row_chunks=1)  # one slice: the whole batch
    restored = Checkpoint.from_config(Checkpoint(block, row_chunks=4).get_config())
    assert restored.row_chunks == 4 and Checkpoint.from_config(Checkpoint(block).get_config()).row_chunks is None


def test_row_chunks_with_an_output_no_gradient_reaches():
    """A block that also returns an integer tensor (a remat segment passing a padding mask on):
    no gradient reaches that output (None), and the slices' gradients come from the others."""
    keras.utils.set_random_seed(0)
    inputs, mask = keras.Input((5,)), keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(16, activation="gelu")(inputs)
    block = keras.Model([inputs, mask], [keras.layers.Dense(5)(hidden), mask])
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 5)).astype("float32"))
    ones = tf.ones((8, 5), "int32")

    def gradients(call):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(call([x, ones])[0]))
        return tape.gradient(loss, block.trainable_variables)

    chunked = Checkpoint(block, row_chunks=3)
    for compiled in (False, True):  # the block its own XLA computation, as under host_offload
        with kvram.layers._compiling.compiled_blocks() if compiled else contextlib.nullcontext():
            ours = tf.function(lambda: gradients(lambda inputs: chunked(inputs, training=True)))()
        assert max_rel_diff(gradients(block), ours) < 1e-6


def test_row_chunks_refuse_inputs_of_other_first_dimensions():
    inputs, table = keras.Input((5,)), keras.Input((5,), batch_size=3)
    block = keras.Model([inputs, table], keras.layers.Dense(5)(inputs))
    chunked = Checkpoint(block, row_chunks=2)
    with pytest.raises(ValueError, match=r"each must have the same first dimension. Received inputs of shapes "
                                         r"\[\(8, 5\), \(3, 5\)\] for row_chunks=2"):
        chunked([tf.ones((8, 5)), tf.ones((3, 5))], training=True)


def test_row_chunks_of_a_block_without_weights_pass_the_gradient_through():
    """A block with no weights (an activation): its input's gradient, slice by slice."""
    block = keras.Sequential([keras.Input((5,)), keras.layers.Activation("gelu")])
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 5)).astype("float32"))

    def gradient(call):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(call(x)))
        return tape.gradient(loss, [x])

    chunked = Checkpoint(block, row_chunks=3)
    assert max_rel_diff(gradient(block), tf.function(lambda: gradient(lambda t: chunked(t, training=True)))()) < 1e-6
