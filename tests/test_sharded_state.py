"""kvram.optimizers.ShardedState: each replica of a MirroredStrategy over two logical CPUs keeps
half of the optimizer state (ZeRO stage 1)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.optimizers import AdamW8bit, ShardedState


def _make(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(128, activation="tanh")(inputs)
    model = kvram.Model(inputs, keras.layers.Dense(3)(hidden), clip_global_norm=None)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 3)).astype("float32")


def _adamw():
    optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.1, global_clipnorm=1.0)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("inner", [_adamw, pytest.param(lambda: AdamW8bit(1e-2, min_8bit_size=64, block_size=64),
                                                         marks=pytest.mark.slow)], ids=["adamw", "adamw8bit"])
def test_two_replicas_train_as_one_device_on_half_the_state_each(inner, mirrored):
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    one = _make(inner())
    one.fit(dataset, epochs=2, verbose=0)
    with mirrored.scope():
        two = _make(ShardedState(inner()))
    two.fit(dataset, epochs=2, verbose=0)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    assert int(two.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == 8
    # each replica keeps about half of the state that one device keeps whole, on its own device
    def nbytes(variables):
        return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables if len(v.shape))

    whole = nbytes(one.optimizer.variables)
    for replica, device in enumerate(mirrored.extended.worker_devices):
        kept = two.optimizer.shard_variables(replica)
        where = {tf.DeviceSpec.from_string(v.value.device).device_index for v in kept}
        assert where == {tf.DeviceSpec.from_string(device).device_index}, (device, where)
        state = nbytes(kept[len(two.trainable_weights):])  # without the float32 master chunks
        assert state <= 0.55 * whole, (state, whole)


def test_a_nonfinite_replica_skips_the_step_and_every_shard_stays(mirrored):
    x, y = _data(32)
    with mirrored.scope():
        model = _make(ShardedState(_adamw()))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    before = [v.numpy() for v in model.weights + model.optimizer.variables]
    bad = x[:16].copy()
    bad[12] = np.nan  # in the second replica's half of the global batch
    model.fit(bad, y[:16], batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(before, [v.numpy() for v in model.weights + model.optimizer.variables]):
        np.testing.assert_array_equal(a, b)
    assert model.skipped_steps == 1


@pytest.mark.slow  # two models trained and restored
def test_shards_are_saved_and_restored_bit_for_bit(mirrored, tmp_path):
    x, y = _data()
    with mirrored.scope():
        model = _make(ShardedState(AdamW8bit(1e-2, min_8bit_size=64, block_size=64)))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    with mirrored.scope():
        again = _make(ShardedState(AdamW8bit(1e-2, min_8bit_size=64, block_size=64)))
    again.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # built, then moved on
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).restore(path)
    assert len(again.optimizer.variables) == len(model.optimizer.variables)
    for a, b in zip(model.weights + model.optimizer.variables, again.weights + again.optimizer.variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    for m in (model, again):
        m.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_on_one_device_it_is_the_inner_optimizer():
    x, y = _data()
    plain, sharded = _make(_adamw()), _make(ShardedState(_adamw()))
    for model in (plain, sharded):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(plain.get_weights(), sharded.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.parametrize("inner, message", [
    (lambda: keras.optimizers.AdamW(clipnorm=1.0), "clipnorm=1.0"),
    (lambda: keras.optimizers.AdamW(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.AdamW()), "not a LossScaleOptimizer"),
])
def test_what_it_cannot_shard_is_refused_with_what_is_allowed(inner, message):
    with pytest.raises(ValueError, match=message):
        ShardedState(inner())


def test_each_replica_compiled_alone_shards_with_collectives(mirrored, monkeypatch):
    """On GPUs under `jit_compile` each replica's step is its own XLA computation (no merge_call):
    the sharded update's sum and gather are collective all-reduces inside it. Traced, not run, with
    MirroredStrategy's GPU check patched, as tests/test_distribute.py traces the GPUs' path."""
    from tensorflow.python.distribute import mirrored_run, mirrored_strategy

    x, y = _data()
    with mirrored.scope():
        model = _make(ShardedState(_adamw()))
        model.compile(optimizer=model.optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds every variable
    for module in (mirrored_strategy, mirrored_run):
        monkeypatch.setattr(module, "_is_gpu_device", lambda device: True)
    model.jit_compile = True
    batch = next(iter(mirrored.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))))
    model.make_train_function(force=True)
    graph = model.train_function._fused(None, batch).get_concrete_function(batch).graph
    ops = {op.type for f in graph._functions.values() for op in f.graph.get_operations()}
    assert "CollectiveReduceV2" in ops, sorted(ops)  # summed and gathered without merge_call


def test_kvram_models_accumulation_is_refused_before_anything_is_built():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = kvram.Model(inputs, keras.layers.Dense(3)(inputs), accumulation_steps=2)
    model.compile(optimizer=ShardedState(keras.optimizers.AdamW()), loss="mse")
    x, y = _data(16)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 \(kvram.Model's accumulation_steps"):
        model.fit(x, y, verbose=0)
    assert not model.optimizer.built


def test_under_mixed_float16_a_loss_scale_optimizer_wraps_it_on_two_replicas(mirrored):
    keras.config.set_dtype_policy("mixed_float16")  # (conftest puts float32 back)
    x, y = _data()
    with mirrored.scope():
        model = _make(ShardedState(keras.optimizers.AdamW(1e-2)))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False).history["loss"]
    assert np.isfinite(history[-1]) and history[-1] < history[0], history
    copies = [v.value.values for v in model.trainable_weights]  # the replicas' copies stay equal
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in copies)
