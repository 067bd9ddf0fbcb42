"""kvram.optimizers.HostOffload and kvram.Model(host_offload=True): the optimizer's state and
float32 master weights on the host (CPU:0), the model's weights on another device (the second
logical CPU stands in for the GPU)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.optimizers import AdamW8bit, HostOffload, _host
from tests.helpers import in_own_process

DEVICE = "/CPU:1"


def _data(rows=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    return x, (x @ rng.normal(size=(12, 3))).astype("float32")


def _model(seed=0, **kvram_args):
    keras.utils.set_random_seed(seed)
    with tf.device(DEVICE):
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        return kvram.Model(inputs, keras.layers.Dense(3)(hidden), **kvram_args)


def _adamw(learning_rate=1e-2):
    optimizer = keras.optimizers.AdamW(learning_rate, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def _inner(name):
    """A new inner optimizer: "adamw" (_adamw) or "adamw8bit" (8-bit from 64 values, blocks of 64)."""
    return _adamw() if name == "adamw" else AdamW8bit(1e-2, weight_decay=0.1, min_8bit_size=64, block_size=64)


def _device(variable):
    return tf.DeviceSpec.from_string(variable.value.device)


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])  # an XLA compile
def test_the_host_update_equals_the_one_on_the_device(jit):
    args = {"accumulation_steps": 2, "clip_global_norm": 0.5}
    x, y = _data()
    with tf.device(DEVICE):  # the step's device, as a GPU is by default: XLA's runs on the model's weights
        plain = _model(**args)
        plain.compile(_adamw(), "mse", jit_compile=jit)
        offloaded = _model(**args, host_offload=True)
        offloaded.compile(_adamw(), "mse", jit_compile=jit)
    assert isinstance(offloaded.optimizer, HostOffload) and offloaded.jit_compile is False
    assert offloaded.inner_optimizer.gradient_accumulation_steps == 2
    for model in (plain, offloaded):
        with tf.device(DEVICE):
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert int(offloaded.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 6  # 12 batches, 2 each
    for a, b in zip(plain.get_weights(), offloaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    assert np.abs(plain.get_weights()[0] - _model().get_weights()[0]).max() > 1e-2  # it trained
    # the model's weights stayed on their device; masters, moments and accumulators are the host's
    assert {_device(v).device_index for v in offloaded.weights} == {1}
    host_state = offloaded.inner_optimizer.variables + offloaded.optimizer.masters
    assert {(_device(v).device_type, _device(v).device_index) for v in host_state} == {("CPU", 0)}
    for weight, master in zip(offloaded.trainable_weights, offloaded.optimizer.masters):
        assert master.dtype == "float32" and np.array_equal(weight.numpy(), master.numpy())


def test_micro_batches_sum_on_the_device_and_update_on_the_host_as_without_offload():
    x, y = _data()
    with tf.device(DEVICE):
        plain = _model(micro_batch_size=8)
        plain.compile(_adamw(), "mse")
        offloaded = _model(micro_batch_size=8, host_offload=True)
        offloaded.compile(_adamw(), "mse")
        for model in (plain, offloaded):
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), offloaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_a_host_offload_passed_to_compile_works_as_the_option_and_without_xla_on_the_host():
    x, y = _data()
    with tf.device(DEVICE):
        plain = _model()
        plain.compile(_adamw(), "mse")
        given = _model()  # no host_offload=True: the optimizer says it
        given.compile(HostOffload(_adamw(), jit_compile=False), "mse")
        for model in (plain, given):
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert given.jit_compile is False and not given.optimizer.jit_compile
    for a, b in zip(plain.get_weights(), given.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_bfloat16_weights_are_the_rounded_float32_masters():
    """Updates of about 1e-3 on weights near 1 are under half a bfloat16 step: kept in the float32
    masters, they add up and move the bfloat16 weights."""
    keras.config.set_dtype_policy("bfloat16")  # (conftest puts float32 back)
    keras.utils.set_random_seed(0)
    with tf.device(DEVICE):
        model = kvram.Model(host_offload=True, inputs=(inputs := keras.Input((16,))),
                            outputs=keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs))
    model.compile(keras.optimizers.AdamW(1e-3, weight_decay=0.0), "mse")
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    history = model.fit(x, x @ np.full((16, 1), 1.05, "float32"), batch_size=64, epochs=25, shuffle=False,
                        verbose=0).history["loss"]
    (weight,), (master,) = model.trainable_weights, model.optimizer.masters
    assert weight.dtype == "bfloat16" and master.dtype == "float32"
    assert np.array_equal(weight.numpy(), tf.cast(master, tf.bfloat16).numpy())
    assert history[-1] < 0.1 * history[0], history
    assert np.abs(master.numpy() - 1.05).mean() < 0.01
    # the host holds 4-byte masters, 2-byte gradient copies and AdamW's 8 bytes per parameter
    assert model.optimizer.required_host_bytes(model.trainable_weights)[0] == (4 + 2 + 8) * 16


def test_a_nonfinite_step_changes_neither_weights_nor_host_state():
    x, y = _data(16)
    model = _model(host_offload=True)
    model.compile(_adamw(), "mse", steps_per_execution=1)
    model.train_on_batch(x, y)
    before = [v.numpy() for v in model.weights + model.optimizer.variables]
    x[3, 2] = np.nan
    model.train_on_batch(x, y)
    assert model.skipped_steps == 1
    for old, variable in zip(before, model.weights + model.optimizer.variables):
        assert np.array_equal(old, variable.numpy(), equal_nan=True), variable.path


def test_under_mixed_float16_a_loss_scale_optimizer_wraps_it():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    model = _model(host_offload=True)
    model.compile(keras.optimizers.AdamW(1e-2), "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, HostOffload)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0).history["loss"]
    assert history[-1] < history[0] and np.isfinite(history[-1])


@pytest.mark.slow  # two models saved, loaded and trained
def test_host_state_is_saved_and_restored_bit_for_bit(tmp_path):
    x, y = _data()

    def trained():
        model = _model(host_offload=True)
        model.compile(AdamW8bit(1e-2, min_8bit_size=64, block_size=64), "mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    model = trained()
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, HostOffload) and isinstance(loaded.optimizer.inner_optimizer, AdamW8bit)
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy()), a.path
        assert _device(b).device_type == "CPU" and _device(b).device_index == 0, b.path
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    again = trained()
    again.fit(x, y, batch_size=16, epochs=1, verbose=0)  # moved on, then restored
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).restore(path)
    for a, b in zip(model.optimizer.variables + model.weights, again.optimizer.variables + again.weights):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    # resumed training goes on as the uninterrupted one does
    for m in (model, loaded, again):
        m.train_on_batch(x[:16], y[:16])
    for a, b, c in zip(model.get_weights(), loaded.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("inner", [
    lambda: keras.optimizers.AdamW(), lambda: keras.optimizers.SGD(momentum=0.9),
    lambda: keras.optimizers.Adam(amsgrad=True, gradient_accumulation_steps=2),
    lambda: AdamW8bit(min_8bit_size=200, block_size=64)])
def test_the_bytes_counted_before_build_are_those_build_allocates(inner):
    model = _model()
    optimizer = HostOffload(inner())
    need, exact = optimizer.required_host_bytes(model.trainable_variables)
    optimizer.build(model.trainable_variables)
    allocated = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in optimizer.variables
                    if len(v.shape))
    gradients = 4 * model.count_params()  # a step's copies (float32 weights here), not variables
    # the update's working copies: AdamW8bit's float32 ones (32 bytes per value of an 8-bit weight,
    # 8 of a smaller one); Keras's update in place in one XLA computation (HostOffload's default)
    working = (32 * 12 * 32 + 8 * (32 + 32 * 3 + 3)) if isinstance(optimizer.inner_optimizer, AdamW8bit) else 0
    assert exact and need == allocated + gradients + working
    # updated on the device, the gradients are not copied to the host
    on_device = HostOffload(inner(), update_device=DEVICE)
    assert on_device.required_host_bytes(model.trainable_variables) == (allocated, True)


def test_a_host_too_small_is_refused_with_the_numbers_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(_host, "available_host_bytes", lambda: 1000)
    model = _model(host_offload=True)
    model.compile(keras.optimizers.Adam(), "mse")
    x, y = _data(16)
    parameters = model.count_params()
    with pytest.raises(MemoryError, match=rf"needs 0\.00 GiB .* {parameters:,} parameters.*has 0\.00 GiB free") as e:
        model.fit(x, y, verbose=0)
    assert ("a step's gradients (0.00 GiB), Adam's state (0.00 GiB) and its update's working copies (0.00 GiB, "
            "for every weight at once)") in str(e.value)
    assert not model.optimizer.built and model.optimizer.masters == []
    need, _ = model.optimizer.required_host_bytes(model.trainable_variables)
    assert need == 16 * parameters  # float32 masters, float32 gradient copies and Adam's two moments


@pytest.mark.parametrize("inner,groups,jit", [
    ("adamw8bit", 1, True), ("adamw8bit", 2, True), ("adamw8bit_factored", 1, True), ("adamw", 1, True),
    ("adamw8bit", 1, False), ("adamw", 1, False)])
def test_an_updates_working_memory_stays_within_what_the_host_check_counts(inner, groups, jit):
    """Over one update of 1M bfloat16 weights on the host (after two), the CPU allocator's peak above
    what was in use stays within what `required_host_bytes` counts for it beyond masters and state:
    the gradients' copies, the updated weights' values, and the working copies of the update
    (AdamW8bit's 8-bit moments dequantized and requantized in float32) of every weight, or with
    groups of the largest weight, plus 1 MiB. Where the count left the working copies out, a host
    too small for them was not refused (the update took 14 to 30 bytes per parameter of a run on
    top; with groups=2, one computation a run exceeded one weight's count)."""
    with tf.device(DEVICE):
        weights = [keras.Variable(np.full((256, 1024), 0.01, np.float32), dtype="bfloat16", name=f"w{i}")
                   for i in range(4)]
        grads = [tf.fill((256, 1024), tf.constant(1e-3, tf.bfloat16)) for _ in weights]
    make = {"adamw8bit": lambda: AdamW8bit(1e-3), "adamw8bit_factored": lambda: AdamW8bit(1e-3, factored=True),
            "adamw": lambda: keras.optimizers.AdamW(1e-3)}[inner]
    optimizer = HostOffload(make(), groups=groups, jit_compile=jit)
    _, copies, _, working, _ = optimizer._host_parts(weights)
    for _ in range(2):
        optimizer.apply_gradients(zip(grads, weights))
    weights[0].numpy()
    kvram.memory.reset_peak("CPU:0")
    before = kvram.memory.current_bytes("CPU:0")
    optimizer.apply_gradients(zip(grads, weights))
    weights[0].numpy()
    peak = kvram.memory.peak_bytes("CPU:0") - before
    values = 2 * 4 * 256 * 1024  # the updated bfloat16 weights, made before the old ones are let go
    assert peak <= copies + values + working + 2**20, (peak / 2**20, copies / 2**20, working / 2**20)
    if inner.startswith("adamw8bit"):  # what it counts is float32 copies: more than a master's 4 bytes
        assert working >= 4 * 4 * 4 * 256 * 1024 // groups


def test_an_optimizer_it_does_not_know_is_counted_as_adam_and_the_message_says_so(monkeypatch):
    class Mine(keras.optimizers.SGD):
        pass

    monkeypatch.setattr(_host, "available_host_bytes", lambda: 16)
    model = _model()
    with pytest.raises(MemoryError, match=r"Mine's state \(0\.00 GiB, counted as Adam's 8 bytes per parameter\)"):
        HostOffload(Mine()).build(model.trainable_variables)


def test_inside_a_whole_step_xla_computation_it_says_what_to_do():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    model.compile(HostOffload(keras.optimizers.Adam()), "mse", jit_compile=True)
    x, y = _data(16)
    with pytest.raises(ValueError, match=r"cannot sit inside the step's XLA computation .* kvram.Model\(host_offload"):
        model.fit(x, y, verbose=0)


def test_bad_arguments_say_what_was_given_and_what_is_allowed():
    with pytest.raises(ValueError, match="host must name one of this machine's CPUs. Received: host='/GPU:0'"):
        HostOffload(keras.optimizers.Adam(), host="/GPU:0")
    with pytest.raises(ValueError, match="not a LossScaleOptimizer"):
        HostOffload(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(ValueError, match="host_offload=True .* update_in_backward=True"):
        _model(host_offload=True, update_in_backward=True)
    with pytest.raises(TypeError, match="host_offload"):
        _model(host_offload="yes")
    model = _model(host_offload=True)
    with pytest.raises(ValueError, match="Received: a LossScaleOptimizer"):
        model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), "mse")
    assert getattr(model, "optimizer", None) is None  # the refused compile changed nothing


def test_the_guard_and_the_update_read_host_copies_of_the_gradients():
    """Each gradient is copied to the host as it is made: in the traced step, the guard's checks
    run on the host, so no op on the device waits for every gradient."""
    x, y = _data(16)
    with tf.device(DEVICE):
        model = _model(host_offload=True)
        model.compile(_adamw(), "mse")
        model.train_on_batch(x, y)  # built
        graph = tf.function(model.train_step).get_concrete_function((tf.constant(x), tf.constant(y))).graph
    checks = [op for op in graph.get_operations() if op.type == "IsFinite"]
    assert len(checks) == len(model.trainable_weights)
    assert all(tf.DeviceSpec.from_string(op.device).device_index == 0 for op in checks), [op.device for op in checks]
    # the update itself: one XLA computation, called on the host (inside the guard's conditional)
    library = graph.as_graph_def().library.function
    compiled = {f.signature.name for f in library if f.attr["_XlaMustCompile"].b}
    calls = [node.device for f in library for node in f.node_def
             if "f" in node.attr and node.attr["f"].func.name in compiled]
    assert calls and all(tf.DeviceSpec.from_string(device).device_index == 0 for device in calls), calls


def _backward_passes(graph):
    """(the names of the XLA computations in the traced step `graph` that are a block's backward pass,
    the names of those its calls run: one a call)."""
    compiled = [f.signature.name for f in graph.as_graph_def().library.function if f.attr["_XlaMustCompile"].b]
    calls = [op.get_attr("f").name for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall") and "backward" in op.get_attr("f").name]
    return [name for name in compiled if "backward" in name], calls


def _blocks_model(policy="full", dropout=0.1, row_chunks=None, **kvram_args):
    keras.utils.set_random_seed(0)
    with tf.device(DEVICE):
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(32)(inputs)
        for _ in range(3):
            hidden = kvram.layers.Checkpoint(keras.Sequential([
                keras.layers.Dense(32, activation="relu"), keras.layers.Dropout(dropout), keras.layers.Dense(32)]),
                policy=policy, row_chunks=row_chunks)(hidden)
        return kvram.Model(inputs, keras.layers.Dense(3)(hidden), **kvram_args)


@pytest.mark.slow  # XLA compiles per block: 6-11 s each on 2 cores
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_checkpointed_blocks_compile_one_by_one_and_train_as_the_whole_step_does(policy, request):
    """Under host_offload with XLA, each Checkpoint block is its own XLA computation (forward, and
    recomputation with backward), so its gradients are made, and go to the host, block by block. With
    policy "full" the three blocks, alike, call one compiled backward pass, each with its own weights;
    "save_dots" blocks compile their own."""
    if in_own_process(request):
        return
    x, y = _data()
    with tf.device(DEVICE):
        whole = _blocks_model(policy)
        whole.compile(_adamw(), "mse", jit_compile=True)  # one XLA computation per step
        blocks = _blocks_model(policy, host_offload=True)
        blocks.compile(_adamw(), "mse", jit_compile=True)
        for model in (whole, blocks):
            keras.utils.set_random_seed(5)  # the same dropout masks
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        graph = tf.function(blocks.train_step).get_concrete_function((tf.constant(x[:16]), tf.constant(y[:16]))).graph
    # XLA whole against XLA block by block: measured 1.7e-6 apart
    for a, b in zip(whole.get_weights(), blocks.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    backward, calls = _backward_passes(graph)
    if policy == "full":  # shared by the blocks alike, called once for each
        assert len(backward) == 1 and len(calls) == 3, (backward, calls)
    else:
        assert len(backward) == 3, backward  # one per block


@pytest.mark.slow  # XLA compiles per block
def test_blocks_alike_with_batch_normalization_share_their_passes_and_each_keeps_its_own_statistics():
    """Three alike Checkpoint blocks with BatchNormalization under host_offload with XLA: they share one
    compiled backward pass, and each block's moving statistics, like its weights, are those the whole
    step on the device gives it (1e-5)."""
    def model(**kvram_args):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        # no bias before a normalization: its gradient is rounding noise, which Adam scales up
        hidden = keras.layers.Dense(32, use_bias=False)(inputs)
        for _ in range(3):
            hidden = kvram.layers.Checkpoint(keras.Sequential([
                keras.layers.Dense(32, use_bias=False), keras.layers.BatchNormalization(), keras.layers.ReLU()]))(hidden)
        return kvram.Model(inputs, keras.layers.Dense(3)(hidden), **kvram_args)

    x, y = _data()
    with tf.device(DEVICE):
        whole, blocks = model(), model(host_offload=True)
        for m in (whole, blocks):
            m.compile(_adamw(), "mse", jit_compile=True)
            m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        graph = tf.function(blocks.train_step).get_concrete_function((tf.constant(x[:16]), tf.constant(y[:16]))).graph
    statistics = [v for v in blocks.non_trainable_variables if "moving" in v.path]
    assert len(statistics) == 6 and len({float(np.sum(v.numpy())) for v in statistics}) == 6, statistics
    for a, b in zip(whole.variables, blocks.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=b.path)
    backward, _ = _backward_passes(graph)
    assert len(backward) == 1, backward


@pytest.mark.slow  # XLA compiles per block
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_row_chunked_blocks_make_each_gradient_once_a_step_and_train_as_the_whole_batch(request):
    """Under host_offload with XLA, Checkpoint(row_chunks=4) blocks run each 16-row batch in slices
    of 4 rows: each block's recomputation and backward pass over its four slices is one XLA
    computation, which makes each of its weights' gradients once, summed over the slices (so each
    crosses to the host once a step), and training equals the whole step's on the device (no
    dropout: the rows do not depend on each other). The three blocks are alike: one compiled
    backward pass, traced once, is called once for each, with that block's weights."""
    if in_own_process(request):
        return
    x, y = _data()
    with tf.device(DEVICE):
        whole = _blocks_model(dropout=0.0)
        whole.compile(_adamw(), "mse", jit_compile=True)  # one XLA computation per step
        chunked = _blocks_model(dropout=0.0, row_chunks=4, host_offload=True)
        chunked.compile(_adamw(), "mse", jit_compile=True)
        for model in (whole, chunked):
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        graph = tf.function(chunked.train_step).get_concrete_function((tf.constant(x[:16]), tf.constant(y[:16]))).graph
    for a, b in zip(whole.get_weights(), chunked.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    backward, calls = _backward_passes(graph)
    assert len(backward) == 1, backward  # one for the three blocks
    assert len(calls) == 3, calls  # one per block


def test_a_host_without_room_for_the_block_inputs_a_step_keeps_is_refused_as_it_is_traced(monkeypatch):
    """block_inputs="host": `build` counts the masters, state, gradient copies and working copies;
    the step, as it is traced (before anything of it runs), counts the block inputs it keeps on the
    host beside its gradient copies and working copies, and refuses a host without room for them
    (MemAvailable, or the pinned allocator's limit with the masters and state), with the numbers;
    no weight changes. With room, it traces; the count is that step's alone (a plain keras.Model's
    step given the same optimizer afterwards keeps none, and is refused)."""
    x, y = _data()
    with tf.device(DEVICE):
        model = _blocks_model(dropout=0.0, row_chunks=4, host_offload=True)
        offload = HostOffload(_adamw(), block_inputs="host")
        model.compile(offload, "mse", jit_compile=True, steps_per_execution=1)
        offload.build(model.trainable_variables)
    before = model.get_weights()
    masters, copies, state, working, _ = offload._host_parts(model.trainable_variables)
    kept = 3 * 16 * 32 * 4  # three blocks' inputs: 16 rows of 32 float32 values each
    monkeypatch.setattr(_host, "available_host_bytes", lambda: copies + working + kept - 1)
    with tf.device(DEVICE), pytest.raises(MemoryError, match=(
            r"this step keeps 3 blocks' inputs on the host \(0\.00 GiB\); with a step's gradients .* the host has "
            r"0\.00 GiB free \(MemAvailable\)\. No step has run\. Allowed: fewer rows a step")):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert (offload.kept_block_inputs, offload.kept_block_input_bytes) == (3, kept)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(b, a)
    monkeypatch.setattr(_host, "available_host_bytes", lambda: copies + working + kept)
    monkeypatch.setattr(_host, "pinned_host_limit", lambda: masters + state + copies + working + kept - 1)
    batch = (tf.constant(x[:16]), tf.constant(y[:16]))
    with tf.device(DEVICE), pytest.raises(MemoryError, match=r"pinned allocator holds at most .* No step has run"):
        tf.function(model.train_step, autograph=False).get_concrete_function(batch)
    monkeypatch.setattr(_host, "pinned_host_limit", lambda: masters + state + copies + working + kept)
    with tf.device(DEVICE):
        tf.function(model.train_step, autograph=False).get_concrete_function(batch)  # traced, with room for it
    # the count is the traced step's own: a plain keras.Model's step, which keeps none, is refused
    assert (offload.kept_block_inputs, offload.kept_block_input_bytes) == (0, 0)
    with tf.device(DEVICE):
        inputs = keras.Input((12,))
        plain = keras.Model(inputs, model(inputs))
        plain.compile(offload, "mse", jit_compile=False)
        with pytest.raises(ValueError, match=r"this step kept none"):
            plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


@pytest.mark.slow  # XLA compiles per block
def test_blocks_without_row_chunks_keep_their_inputs_on_the_device_and_block_inputs_host_is_refused():
    """Checkpoint blocks without row_chunks share their compiled passes as one slice (cea046f), but
    block_inputs="host" is for row-chunked blocks only: a step of such blocks keeps none there and is
    refused, as documented."""
    x, y = _data()
    with tf.device(DEVICE):
        model = _blocks_model(dropout=0.0, host_offload=True)
        model.compile(HostOffload(_adamw(), block_inputs="host"), "mse", jit_compile=True)
        with pytest.raises(ValueError, match=r"this step kept none"):
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


@pytest.mark.slow  # XLA compiles per block
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
@pytest.mark.parametrize("row_chunks", [1, 4])
def test_row_chunked_blocks_keep_their_inputs_on_the_host_between_their_passes(row_chunks, request):
    """HostOffload(block_inputs="host"): in each step, each row-chunked block's input (in one slice,
    or four) is copied to the host (CPU:0) after its forward pass, and back to the device (the second
    logical CPU) by an op that waits for the block's output gradients; the weights trained equal
    block_inputs="device"'s."""
    from tensorflow.python.eager import context

    if in_own_process(request):
        return
    x, y = _data()
    models = {}
    for where in ("device", "host"):
        with tf.device(DEVICE):
            model = _blocks_model(dropout=0.0, row_chunks=row_chunks, host_offload=True)
            model.compile(HostOffload(_adamw(), block_inputs=where), "mse", jit_compile=True, steps_per_execution=1)
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        models[where] = model
    for a, b in zip(models["device"].get_weights(), models["host"].get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    # compiled again without XLA, its step keeps no block input: refused, not run on a count left over
    offload = models["host"].optimizer
    with tf.device(DEVICE):
        models["host"].compile(offload, "mse", jit_compile=False, steps_per_execution=1)
        with pytest.raises(ValueError, match=r"this step kept none"):
            models["host"].fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        models["host"].compile(offload, "mse", jit_compile=True, steps_per_execution=1)
    step = tf.function(models["host"].train_step)
    context.enable_run_metadata()  # the partition graphs of a function's first run
    with tf.device(DEVICE):
        step((tf.constant(x[:16]), tf.constant(y[:16])))
    metadata = context.export_run_metadata()
    context.disable_run_metadata()
    ran = [n for f in metadata.function_graphs for g in f.partition_graphs for n in g.node]
    to_host = [n.device for n in ran if n.op == "Snapshot" and "block_input_to_host" in n.name]
    released = [n for n in ran if n.op == "Snapshot" and "block_input_released" in n.name]
    receives = [n for n in ran if n.op == "_Recv" and "block_input_released" in n.attr["tensor_name"].s.decode()]
    received = [n.device for n in receives]
    # what reads each on the device: the block's backward computation, nothing else
    readers = [m.op for r in receives for m in ran if any(i.split(":")[0] == r.name for i in m.input)]
    assert readers == ["StatefulPartitionedCall"] * 3, readers
    assert len(to_host) == 3 and all(d.endswith("CPU:0") for d in to_host), to_host  # one a block
    # released on the host once a control input (the block's output gradients) arrives, then received
    assert len(released) == 3 and all(n.device.endswith("CPU:0") for n in released), [n.device for n in released]
    assert all(any(i.startswith("^") for i in n.input) for n in released), [list(n.input) for n in released]
    assert len(received) == 3 and all(d.endswith("CPU:1") for d in received), received


def test_block_inputs_must_be_device_or_host_and_a_step_that_keeps_none_is_refused():
    """A bad value is refused; so is block_inputs="host" where the step keeps no block's inputs on
    the host (here: no row-chunked block, no XLA), before any weight changes."""
    with pytest.raises(ValueError, match=r'block_inputs must be "device" or "host". Received: block_inputs=\'gpu\''):
        HostOffload(_adamw(), block_inputs="gpu")
    assert HostOffload(_adamw(), block_inputs="host").get_config()["block_inputs"] == "host"
    x, y = _data()
    model = _model(host_offload=True)
    model.compile(HostOffload(_adamw(), block_inputs="host"), "mse", jit_compile=False)
    before = model.get_weights()
    with pytest.raises(ValueError, match=r'block_inputs="host" keeps the inputs of .*this step kept none'):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # three fits
def test_a_fit_interrupted_mid_epoch_resumes_from_its_backup_with_the_host_state(tmp_path):
    """keras.callbacks.BackupAndRestore keeps the masters and the host's optimizer state with the
    weights: a fit killed in its third epoch, run again, ends where an uninterrupted fit ends."""
    x, y = _data()

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.epoch == 2 and batch == 1:
                raise KeyboardInterrupt("stopped in the middle of epoch 3")

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    def fit(callbacks):
        model = _model(host_offload=True)
        model.compile(AdamW8bit(1e-2, min_8bit_size=64, block_size=64), "mse", steps_per_execution=1)
        model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
        return model

    whole = fit([])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        fit([backup, Interrupt()])
    resumed = fit([keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy()) == 16
    for a, b in zip(whole.get_weights() + [v.numpy() for v in whole.optimizer.masters],
                    resumed.get_weights() + [v.numpy() for v in resumed.optimizer.masters]):
        np.testing.assert_array_equal(a, b)


def test_an_embeddings_sparse_gradient_is_updated_on_the_host_as_on_the_device():
    """An Embedding's gradient is tf.IndexedSlices: copied, cast and applied as such."""
    ids = np.random.default_rng(0).integers(0, 50, (32, 6)).astype("int32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")

    def model(**kvram_args):
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            inputs = keras.Input((6,), dtype="int32")
            hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
            built = kvram.Model(inputs, keras.layers.Dense(1)(hidden), **kvram_args)
            built.compile(_adamw(), "mse")
        return built

    plain, offloaded = model(), model(host_offload=True)
    for m in (plain, offloaded):
        with tf.device(DEVICE):
            m.fit(ids, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), offloaded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("inner", ["adamw", "adamw8bit"])
def test_runs_of_weights_updated_one_by_one_equal_one_update(inner):
    """HostOffload(groups=3): three updates on the host, one per run of weights, the last run first,
    and the step count moved once: the weights and the host's state equal one update's (1e-6), with
    weight decay (biases excluded) and per-weight clipping, without the guard (skip_nonfinite=False)."""
    x, y = _data()
    models = []
    for groups in (1, 3):
        with tf.device(DEVICE):
            model = _model(skip_nonfinite=False)
            optimizer = _inner(inner)
            optimizer.clipnorm = 1.0
            model.compile(HostOffload(optimizer, groups=groups), "mse")
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        models.append(model)
    one, runs = models
    assert int(runs.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 12
    for a, b in zip(one.get_weights(), runs.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    for a, b in zip(one.optimizer.variables, runs.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    assert np.abs(one.get_weights()[0] - _model().get_weights()[0]).max() > 1e-2  # it trained
    assert runs.optimizer.get_config()["groups"] == 3


def test_weights_of_one_shape_share_one_compiled_update_and_each_keeps_its_own_state():
    """HostOffload(AdamW8bit, groups=4): the per-weight updates of weights of one shape, dtype and decay
    are one XLA computation, traced once, the weight and its state its arguments: four 16x16 kernels
    (8-bit moments, decayed) and four biases (float32 moments, not decayed) make two. Weights and state
    equal one update of them all (groups=1, 1e-6) after 3 epochs, per-weight clipping included."""
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    models = []
    for groups in (1, 4):
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            inputs = keras.Input((16,))
            hidden = inputs
            for _ in range(4):
                hidden = keras.layers.Dense(16, activation="tanh")(hidden)
            model = kvram.Model(inputs, hidden, skip_nonfinite=False)
            optimizer = _inner("adamw8bit")
            optimizer.exclude_from_weight_decay(var_names=["bias"])
            optimizer.clipnorm = 1.0
            model.compile(HostOffload(optimizer, groups=groups), "mse")
            model.fit(x, np.sin(x), batch_size=16, epochs=3, shuffle=False, verbose=0)
        models.append(model)
    one, runs = models
    shared = {key: f for key, f in runs.optimizer._updates.items() if key[0] == "shared"}
    assert len(runs.optimizer._updates) == len(shared) == 2, list(runs.optimizer._updates)
    assert [f.experimental_get_tracing_count() for f in shared.values()] == [1, 1]
    for a, b in zip(one.get_weights(), runs.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    for a, b in zip(one.optimizer.variables, runs.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    kernels = [w for w in runs.get_weights() if w.ndim == 2]
    assert min(np.abs(a - b).max() for a, b in zip(kernels, kernels[1:])) > 1e-2  # four weights, not one


@pytest.mark.parametrize("inner, groups", [("adamw", 1), ("adamw8bit", 3)])
def test_an_update_on_the_device_equals_the_hosts_and_leaves_the_state_on_the_host(inner, groups):
    """HostOffload(update_device=...): the update's arithmetic on the model's device, reading and
    writing the host's masters and state. Weights and host state equal the host's update (1e-6),
    with weight decay and per-weight clipping; the state stays the host's; in the traced step the
    gradients are not copied to the host and the update's square roots run on the device."""
    x, y = _data()
    models = []
    for where in (None, DEVICE):
        with tf.device(DEVICE):
            model = _model(skip_nonfinite=False)
            optimizer = _inner(inner)
            optimizer.clipnorm = 1.0
            model.compile(HostOffload(optimizer, groups=groups, jit_compile=False, update_device=where), "mse")
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
        models.append(model)
    host, device = models
    for a, b in zip(host.get_weights(), device.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    for a, b in zip(host.optimizer.variables, device.optimizer.variables):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    assert np.abs(host.get_weights()[0] - _model().get_weights()[0]).max() > 1e-2  # it trained
    state = device.inner_optimizer.variables + device.optimizer.masters
    assert {(_device(v).device_type, _device(v).device_index) for v in state} == {("CPU", 0)}
    assert device.optimizer.get_config()["update_device"] == DEVICE
    for model, index in ((host, 0), (device, 1)):
        with tf.device(DEVICE):
            graph = tf.function(model.train_step).get_concrete_function((tf.constant(x), tf.constant(y))).graph
        roots = {tf.DeviceSpec.from_string(op.device).device_index for op in graph.get_operations() if op.type == "Sqrt"}
        assert roots == {index}, (model.optimizer.update_device, roots)


def test_an_update_on_the_device_reads_each_master_twice_and_writes_it_twice():
    """What HostOffload's docstring and the training guide say crosses between host and device per
    update with `update_device` and AdamW8bit: each master read twice (weight decay, the cast to the
    weight) and written twice (decay, step), each 8-bit state tensor read and written once: 20 bytes
    per parameter. Counted as the reads and writes of each host variable in the traced update (the
    partition graphs TensorFlow ran had as many reads of the masters). Fewer is better: a change that
    lowers them updates the docs and this test."""
    with tf.device(DEVICE):
        weights = [keras.Variable(np.ones((64, 128), "float32"), dtype="bfloat16", name=f"w{i}") for i in range(2)]
        grads = [tf.ones_like(w) for w in weights]
    optimizer = HostOffload(AdamW8bit(1e-3, min_8bit_size=0), update_device=DEVICE, groups=2)
    optimizer.build(weights)
    graph = tf.function(lambda g: optimizer.apply(g, weights)).get_concrete_function(grads).graph
    path = {id(internal): v.path for external, internal in graph.captures for v in optimizer.variables
            if v.value.handle is external}
    counts = {}
    for op in graph.get_operations():
        kind = "read" if op.type == "ReadVariableOp" else "write" if op.type.startswith("Assign") else None
        if kind and id(op.inputs[0]) in path:
            key = (path[id(op.inputs[0])].split("/")[-1].replace("host_offload_", ""), kind)
            counts[key] = counts.get(key, 0) + 1
    for i in range(2):
        assert counts[(f"w{i}_master", "read")] == 2 and counts[(f"w{i}_master", "write")] == 2, counts
        for state in ("momentum_codes", "momentum_scales", "velocity_codes", "velocity_scales"):
            assert counts[(f"w{i}_master_{state}", "read")] == 1, counts
            assert counts[(f"w{i}_master_{state}", "write")] == 1, counts


def test_an_update_device_that_is_not_there_is_refused():
    for bad in ("/GPU:7", "/CPU:9", 3):
        with pytest.raises(ValueError, match=f"update_device must be None or name one of this machine's devices. "
                                             f"Received: update_device={bad!r}. Allowed: None, "):
            HostOffload(keras.optimizers.Adam(), update_device=bad)


def test_runs_are_consecutive_and_of_about_equal_size():
    assert _host._runs([10, 1, 10, 1, 10, 1], 3) == [[0, 1], [2, 3], [4, 5]]
    assert _host._runs([5, 5], 4) == [[0], [1]]  # no more runs than weights
    assert _host._runs([1, 1, 1, 100], 2) == [[0, 1, 2, 3]]  # a run ends once it holds its share
    with pytest.raises(ValueError, match="groups must be a positive int. Received: groups=0"):
        HostOffload("adam", groups=0)
    with pytest.raises(ValueError, match=r"cannot wrap an optimizer with global_clipnorm=1.0, "
                                         r"gradient_accumulation_steps=2 \(kvram.Model's"):
        HostOffload(keras.optimizers.Adam(global_clipnorm=1.0, gradient_accumulation_steps=2), groups=2)


def test_the_update_rate_is_measured_on_the_host_whatever_the_default_device():
    """`kvram plan`'s prediction of the host update's seconds (`_host.update_rate`) where the default
    device is another (a GPU: there the optimizer's learning rate was made on the GPU, and the host's
    XLA update refused to read it, on an H100, 2026-12-06)."""
    with tf.device(DEVICE):
        assert _host.update_rate(keras.optimizers.AdamW(1e-3), 2**12, 1, jit_compile=True) > 0


@pytest.mark.parametrize("update_device", [None, DEVICE])
def test_each_run_reads_its_masters_and_state_after_its_gradients_and_the_run_before(update_device):
    """With `groups`, a run's masters and state are read (with update_device: copied to that device)
    only once its gradients are made and the run updated before it has its values: without that,
    TensorFlow's executor read every run's at the step's start, all of them at once on the device."""
    with tf.device(DEVICE):
        model = _model()
        optimizer = HostOffload(_inner("adamw8bit"), groups=2, jit_compile=False, update_device=update_device)
        model.compile(optimizer, "mse")
        weights = model.trainable_variables
        optimizer.build(weights)
        gradients = [tf.TensorSpec(w.shape, w.dtype) for w in weights]
        graph = tf.function(lambda g: optimizer.apply(g, weights)).get_concrete_function(gradients).graph
    placeholders = graph.inputs[: len(weights)]
    inside = {id(external): internal for external, internal in graph.captures}
    runs = [list(run) for run in reversed(_host._runs([int(np.prod(w.shape)) for w in weights], 2))]
    assert len(runs) == 2

    def ancestors(op):
        seen, todo = set(), [op]
        while todo:
            current = todo.pop()
            for parent in [t.op for t in current.inputs] + list(current.control_inputs):
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return seen

    def readers(variables):
        handles = {id(inside[id(v.handle)]) for v in variables if id(v.handle) in inside}
        return [op for op in graph.get_operations() if op.type == "ReadVariableOp" and id(op.inputs[0]) in handles]

    state = {id(m): [v for v in optimizer.inner_optimizer.variables if m.path.split("/")[-1] in v.path]
             for m in optimizer.masters}
    for position, run in enumerate(runs):
        own = [optimizer.masters[i] for i in run]
        assert all(state[id(m)] for m in own), state  # each master's moments found by name
        reads = readers(own + [v for m in own for v in state[id(m)]])
        assert len(reads) >= 3 * len(own), [op.name for op in reads]
        earlier = [placeholders[i].op for r in runs[: position + 1] for i in r]  # this run's, and the run before's
        for op in reads:
            missing = [p.name for p in earlier if p not in ancestors(op)]
            assert not missing, (op.name, missing)


def test_pinned_host_memory_is_counted_against_tensorflows_pinned_allocator(monkeypatch):
    """Where host memory is pinned, the masters and state come from TensorFlow's pinned allocator
    (64 GiB unless TF_GPU_HOST_MEM_LIMIT_IN_MB): a need above it is refused up front, saying what to set."""
    assert _host.pinned_host_limit({}, pinned=False) is None
    assert _host.pinned_host_limit({}, pinned=True) == 64 * 2**30
    assert _host.pinned_host_limit({"TF_GPU_HOST_MEM_LIMIT_IN_MB": "100000"}, pinned=True) == 100000 * 2**20
    assert _host.pinned_host_limit({"TF_GPU_HOST_MEM_LIMIT_IN_MB": "many"}, pinned=True) == 64 * 2**30
    assert _host.pinned_host_limit() is None  # no GPU here
    model = _model()
    need, _ = HostOffload(keras.optimizers.Adam()).required_host_bytes(model.trainable_variables)
    monkeypatch.setattr(_host, "pinned_host_limit", lambda: need - 1)
    with pytest.raises(MemoryError, match=r"pinned allocator holds at most 0\.00 GiB \(TF_GPU_HOST_MEM_LIMIT_IN_MB, "
                                          r"64 GiB unless set\)\. Nothing was allocated\. Set TF_GPU_HOST_MEM_LIMIT_IN_MB "
                                          r"\(MiB\) above 1, .*KVRAM_PIN_HOST_MEMORY=0") as e:
        HostOffload(keras.optimizers.Adam()).build(model.trainable_variables)
    assert f"{model.count_params():,} parameters" in str(e.value)
    monkeypatch.setattr(_host, "pinned_host_limit", lambda: need)
    HostOffload(keras.optimizers.Adam()).build(model.trainable_variables)  # exactly enough
