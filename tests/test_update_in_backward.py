"""kvram.Model(update_in_backward=True): no step holds every gradient."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram import memory
from tests.helpers import in_own_process


def _mlp(layers=3, width=64, checkpointed=False, **kwargs):
    """Dense layers; `checkpointed`: each a kvram.layers.Checkpoint block, and the head outside them."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(layers):
        dense = keras.layers.Dense(width, activation="relu")
        h = (kvram.layers.Checkpoint(dense) if checkpointed else dense)(h)
    return kvram.Model(inputs, keras.layers.Dense(10)(h), **kwargs)


def _data(rows=32, width=64):
    x = np.random.default_rng(0).random((rows, width)).astype("float32")
    return x, np.arange(rows) % 10


def _trained(jit, epochs=2, **kwargs):
    model = _mlp(**kwargs)
    model.compile(keras.optimizers.AdamW(1e-3, weight_decay=0.01), "sparse_categorical_crossentropy",
                  jit_compile=jit, steps_per_execution=1)
    model.fit(*_data(), batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model


# Under XLA (3-5 s each on 2 cores) one of the four is in `pytest -m "not slow"`; the full suite runs all.
@pytest.mark.parametrize("checkpointed, skip_nonfinite, jit", [
    pytest.param(checkpointed, skip, jit, marks=[pytest.mark.slow] if jit and (checkpointed or not skip) else [])
    for checkpointed in (False, True) for skip in (True, False) for jit in (False, True)])
def test_it_trains_as_the_usual_step_does(jit, skip_nonfinite, checkpointed):
    usual = _trained(jit, checkpointed=checkpointed)
    ours = _trained(jit, update_in_backward=True, skip_nonfinite=skip_nonfinite, checkpointed=checkpointed)
    for a, b in zip(usual.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert int(ours.optimizer.iterations) == int(usual.optimizer.iterations) == 8


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_checkpoint_blocks_apply_their_updates_in_their_backward_pass(skip_nonfinite, monkeypatch):
    """Each block's weights are updated by its own backward pass, and the gradient it passes on
    is computed from the values stored: the block before cannot start its backward pass first."""
    from kvram.layers import _in_backward

    applied = []
    apply = _in_backward.Updates.apply

    def spy(self, variables, gradients):
        left, zero = apply(self, variables, gradients)
        if zero is not None:
            applied.append(sorted(v.name.split("/")[-1].split(":")[0] for v, g in zip(variables, left) if g is None))
        return left, zero

    monkeypatch.setattr(_in_backward.Updates, "apply", spy)
    model = _mlp(checkpointed=True, update_in_backward=True, skip_nonfinite=skip_nonfinite)
    model.compile(keras.optimizers.AdamW(1e-3), "sparse_categorical_crossentropy", steps_per_execution=1)
    x, y = _data(8)

    def step():
        return model.train_step((tf.constant(x), tf.constant(y)))

    graph = tf.function(step).get_concrete_function().graph
    # each block's backward pass applies its kernel and bias (3 blocks per trace of the step)
    assert applied and len(applied) % 3 == 0 and all(names == ["bias", "kernel"] for names in applied)

    def ancestors(op):
        seen, stack = set(), [op]
        while stack:
            for t in stack.pop().inputs:
                if t.op.name not in seen:
                    seen.add(t.op.name)
                    stack.append(t.op)
        return seen

    # the blocks' backward MatMuls (2 a block; the head's are outside them): in the pass that
    # applies, the last block's wait for no update, the two blocks before it for a later block's
    backward = [op for op in graph.get_operations()
                if op.type == "MatMul" and op.name.startswith("gradient_tape/") and "functional" not in op.name]
    waiting = [op for op in backward if any(n.startswith("update_in_backward") for n in ancestors(op))]
    passes = 2 if skip_nonfinite else 1  # skip_nonfinite: a first pass decides the skip, and applies nothing
    assert len(backward) == 6 * passes and len(waiting) == 4


def test_a_weight_read_in_a_block_and_outside_it_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    dense = keras.layers.Dense(8)
    model = kvram.Model(inputs, dense(kvram.layers.Checkpoint(dense)(inputs)), update_in_backward=True)
    model.compile(keras.optimizers.AdamW(1e-3), "mse", jit_compile=False)
    with pytest.raises(ValueError, match=r"dense.*kernel.*is also read outside the block.*Allowed: each weight"):
        model.fit(np.ones((4, 8), "float32"), np.ones((4, 8), "float32"), verbose=0)


def test_a_weight_shared_by_two_blocks_is_updated_after_the_backward_pass():
    def trained(update_in_backward):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        dense = keras.layers.Dense(8, activation="tanh")
        h = kvram.layers.Checkpoint(dense)(kvram.layers.Checkpoint(dense)(inputs))
        model = kvram.Model(inputs, keras.layers.Dense(8)(h), update_in_backward=update_in_backward)
        model.compile(keras.optimizers.AdamW(1e-2), "mse", jit_compile=False)
        model.fit(np.ones((4, 8), "float32"), np.zeros((4, 8), "float32"), epochs=3, verbose=0)
        return model.get_weights()

    for a, b in zip(trained(False), trained(True)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_a_step_with_nonfinite_gradients_changes_nothing(jit):
    model = _trained(jit, epochs=1, update_in_backward=True)
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    x, y = _data(8)
    x[3, 5] = np.nan
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert model.skipped_steps == 1
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)  # weights, moments and the iteration count
    model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 5 and model.skipped_steps == 1
    assert any(not np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))


@pytest.mark.slow  # XLA compiles of an MLP of 8.4M parameters
def test_under_xla_no_point_of_the_step_holds_every_gradient(request):
    """The CPU allocator's peak of training steps beyond what stays (weights,
    moments, batch): the usual guarded step holds every gradient (its finiteness
    decides the update); with update_in_backward, the guard included, XLA
    frees each gradient once its update has read it."""
    # fit()'s peak, in a process of its own: in the suite's, a clean clone's run
    # measured 16.0 MiB with update_in_backward (8.4 alone), what earlier tests
    # left (threads that allocate, the allocator's free blocks) counted with it
    if in_own_process(request):
        return
    x, y = _data(8, 1024)
    peaks = {}
    for name, kwargs in (("usual", {}), ("in_backward", {"update_in_backward": True})):
        model = _mlp(layers=8, width=1024, **kwargs)
        model.compile(keras.optimizers.AdamW(1e-4), "sparse_categorical_crossentropy", jit_compile=True,
                      steps_per_execution=1)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        memory.collect_garbage()
        memory.reset_peak("CPU:0")
        start = memory.current_bytes("CPU:0")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        peaks[name] = memory.peak_bytes("CPU:0") - start
        gradients = sum(v.numpy().nbytes for v in model.trainable_variables)
    # measured: 33.1 and 8.4 MiB, of 32.1 MiB of gradients
    assert peaks["usual"] >= 0.9 * gradients, (peaks, gradients)
    assert peaks["in_backward"] <= 0.4 * gradients, (peaks, gradients)


@pytest.mark.slow  # six XLA compiles (no run) of MLPs of 4.2M-8.4M parameters
def test_under_xla_adamw8bit_reads_each_weights_state_only_once_its_gradient_is_made():
    """XLA's buffer assignment of the update_in_backward step with AdamW8bit: the
    temporary bytes do not grow with depth, nor with stochastic rounding's noise.
    Each weight's float32 moments (dequantized from its 8-bit codes) and rounding
    noise need nothing from the backward pass; scheduled ahead of it, they were all
    held at once (measured: +16.3 MiB for 4 more layers of 4 MiB each, +28.1 MiB of
    noise for 8 layers)."""
    import tensorflow as tf

    from kvram.optimizers import AdamW8bit
    from kvram.remat._check import _assignment

    x, y = (tf.constant(t) for t in _data(8, 1024))

    def temp(layers, policy="float32", rounding="stochastic"):
        keras.config.set_dtype_policy(policy)
        try:
            model = _mlp(layers=layers, width=1024, update_in_backward=True)
            model.compile(AdamW8bit(1e-4, rounding=rounding), "sparse_categorical_crossentropy")
            model.optimizer.build(model.trainable_variables)
            step = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
            return _assignment(step, x, y)["temp"]
        finally:
            keras.config.set_dtype_policy("float32")

    layer = 1024 * 1024 * 4  # a layer's float32 kernel: its moments' float32 copies, its noise
    # measured: 40.0 and 40.3 MiB (56.5 at 8 layers when the state was read ahead)
    assert temp(8) - temp(4) <= 0.25 * 4 * layer
    # measured: 48.4 and 44.4 MiB (98.5 and 70.4 when the noise was drawn ahead)
    assert temp(8, "bfloat16") - temp(8, "bfloat16", "nearest") <= 2 * layer


@pytest.mark.parametrize("kwargs, given", [
    ({"accumulation_steps": 2}, "accumulation_steps=2"), ({"micro_batch_size": 4}, "micro_batch_size=4"),
    ({"clip_global_norm": 1.0}, "clip_global_norm=1.0")])
def test_what_needs_every_gradient_first_is_refused(kwargs, given):
    with pytest.raises(ValueError, match=f"cannot run with what needs every gradient first. Received: {given}"):
        _mlp(update_in_backward=True, **kwargs)


def test_a_loss_scale_optimizer_and_later_micro_batches_are_refused():
    model = _mlp(update_in_backward=True)
    with pytest.raises(ValueError, match="LossScaleOptimizer.*Allowed: mixed_bfloat16 or float32"):
        model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), "mse")
    keras.config.set_dtype_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="LossScaleOptimizer"):
            _mlp(update_in_backward=True).compile("adam", "mse")  # Keras would wrap Adam in one
    finally:
        keras.config.set_dtype_policy("float32")
    with pytest.raises(ValueError, match="micro_batch_size=4 cannot be set on a model with update_in_backward=True"):
        model.micro_batch_size = 4
    with pytest.raises(ValueError, match="use_ema=True"):
        model.compile(keras.optimizers.Adam(use_ema=True), "sparse_categorical_crossentropy")
        model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)


def test_it_is_saved_with_the_model(tmp_path):
    model = _trained(False, epochs=1, update_in_backward=True)
    model.save(tmp_path / "m.keras")
    assert keras.saving.load_model(tmp_path / "m.keras").update_in_backward is True


@pytest.mark.parametrize("checkpointed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kvram_optimizers_are_gated_too_bfloat16_weights_and_kahan_buffers_included(checkpointed):
    from kvram.optimizers import AdamW8bit

    keras.config.set_dtype_policy("bfloat16")
    try:
        model = _mlp(update_in_backward=True, checkpointed=checkpointed)
        model.compile(AdamW8bit(1e-3, weight_decay=0.01, rounding="kahan", min_8bit_size=0, block_size=64),
                      "sparse_categorical_crossentropy", steps_per_execution=1)
        model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)
        before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        x, y = _data(8)
        x[0, 0] = np.inf
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert model.skipped_steps == 1
        for a, v in zip(before, model.variables + model.optimizer.variables):
            np.testing.assert_array_equal(a, v.numpy())
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("checkpointed", [False, True])
def test_without_the_guard_a_nonfinite_step_is_counted_blocks_included(checkpointed):
    """skip_nonfinite=False applies every step; with max_consecutive_skips the non-finite ones
    are counted. Checkpointed, every weight (the head's too) is applied in a block's backward
    pass, so only the blocks' own flags can count it."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    h = inputs
    for width in (64, 64, 10):
        dense = keras.layers.Dense(width, activation="relu" if width == 64 else None)
        h = (kvram.layers.Checkpoint(dense) if checkpointed else dense)(h)
    model = kvram.Model(inputs, h, update_in_backward=True, skip_nonfinite=False, max_consecutive_skips=5)
    model.compile(keras.optimizers.AdamW(1e-3), "sparse_categorical_crossentropy", steps_per_execution=1)
    model.fit(*_data(8), batch_size=8, epochs=1, verbose=0)
    assert model.skipped_steps == 0
    x, y = _data(8)
    x[3, 5] = np.nan
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.skipped_steps == 1
