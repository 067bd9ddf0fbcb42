"""kvram/_state.py: the variables a layer writes, not the weights it was told to keep."""

import keras
import numpy as np

import kvram  # noqa: F401
from kvram import remat
from kvram._state import mutable_state


def _built(layer, shape=(None, 8)):
    layer.build(shape)
    return layer


def test_frozen_and_quantized_weights_are_not_state_moving_statistics_and_seeds_are():
    frozen = _built(keras.layers.Dense(4))
    frozen.trainable = False
    assert frozen.non_trainable_variables and mutable_state(frozen) == []
    quantized = _built(keras.layers.Dense(4))
    quantized.quantize("int8")
    assert quantized.non_trainable_variables and mutable_state(quantized) == []
    float8 = _built(keras.layers.Dense(4))
    float8.quantize("float8")
    assert mutable_state(float8) == []  # its scales and histories: trainable, overwritten by the optimizer
    norm = _built(keras.layers.BatchNormalization())
    assert {v.name for v in mutable_state(norm)} == {"moving_mean", "moving_variance"}
    dropout = keras.layers.Dropout(0.1, seed=3)
    assert [v.name for v in mutable_state(dropout)] == ["seed_generator_state"]


def test_a_frozen_model_keeps_only_its_seeds_as_state():
    inputs = keras.Input((8,))
    h = keras.layers.Dropout(0.1, seed=1)(keras.layers.Dense(8)(inputs))
    model = keras.Model(inputs, keras.layers.BatchNormalization()(h))
    model.trainable = False
    names = sorted(v.name for v in mutable_state(model))
    assert names == ["moving_mean", "moving_variance", "seed_generator_state"], names


def test_a_frozen_tied_embedding_may_be_called_in_several_segments():
    """A LoRA-style model: the tied embedding, frozen, is called at the input and as the head."""
    import keras_hub

    keras.utils.set_random_seed(0)
    tokens = keras.Input((16,), dtype="int32")
    embedding = keras_hub.layers.ReversibleEmbedding(64, 32, name="embed")
    h = embedding(tokens)
    for i in range(3):
        h = keras.layers.Dense(32, activation="gelu", name=f"d{i}")(h)
    model = keras.Model(tokens, embedding(h, reverse=True))
    embedding.trainable = False
    x = np.random.default_rng(0).integers(0, 64, (4, 16)).astype("int32")
    chosen = remat.plan(model, (x, x), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        verbose=0)
    assert [s.layers for s in chosen.segments].count(("embed",)) == 2
    planned = chosen.apply()
    np.testing.assert_allclose(planned(x).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-6)


def test_out_of_memory_recovery_snapshots_moving_statistics_not_frozen_weights():
    """AdaptiveBatchSize's step copies the state a failed gradient pass may have written, before
    each pass: for a frozen backbone, not its weights."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    frozen = keras.layers.Dense(16, name="frozen")
    h = keras.layers.BatchNormalization(name="norm")(frozen(inputs))
    model = kvram.Model(inputs, keras.layers.Dense(1, name="head")(h))
    frozen.trainable = False
    model.compile("adam", "mse")
    x = np.random.default_rng(0).random((16, 8)).astype("float32")
    controller = kvram.callbacks.AdaptiveBatchSize(device="CPU:0", verbose=0)
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[controller])
    snapshotted = {getattr(v, "path", v.name) for v in model.train_function._state}
    assert {"norm/moving_mean", "norm/moving_variance"} <= snapshotted, snapshotted
    assert not snapshotted & {v.path for v in frozen.variables}, snapshotted
