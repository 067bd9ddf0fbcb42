"""The reference models in models/ (not part of the installed package)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from models.vit import vit, vit_b16, vit_tiny
from tests.helpers import max_rel_diff


def test_vit_b16_has_torchvision_vit_b_16_parameter_count():
    model = vit_b16()
    assert model.count_params() == 86_567_656  # torchvision.models.vit_b_16()
    blocks = [layer for layer in model.layers if isinstance(layer, kvram.layers.Checkpoint)]
    assert len(blocks) == 12
    attention = [l for b in blocks for l in b.layer.layers if isinstance(l, kvram.layers.MemoryEfficientAttention)]
    assert len(attention) == 12


def test_efficient_vit_equals_the_keras_attention_vit():
    x = np.random.default_rng(0).random((4, 32, 32, 3)).astype("float32")
    y = np.array([0, 1, 2, 3])
    plain = vit_tiny(attention="keras", checkpoint=False)
    efficient = vit_tiny(attention="efficient", checkpoint=True, chunk_size=16)
    efficient.set_weights(plain.get_weights())
    results = []
    for model in (plain, efficient):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        results.append([logits] + tape.gradient(loss, model.trainable_weights))
    assert max_rel_diff(results[0][:1], results[1][:1]) < 1e-5
    assert max_rel_diff(results[0][1:], results[1][1:], per_tensor=False) < 1e-5


def test_vit_bad_arguments():
    with pytest.raises(ValueError, match="multiple of patch"):
        vit(image_size=30, patch=4)
    with pytest.raises(ValueError, match="'efficient' or 'keras'"):
        vit_tiny(attention="flash")
