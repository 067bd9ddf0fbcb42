"""The reference models in models/ (not part of the installed package)."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from models.vit import vit, vit_b16, vit_tiny
from tests.helpers import in_own_process, max_rel_diff, run_with_peak


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


def test_vit_checkpoints_the_first_blocks_it_is_told():
    for checkpoint, wrapped in ((True, 4), (False, 0), (3, 3), (0, 0)):
        model = vit_tiny(checkpoint=checkpoint)
        names = [layer.layer.name for layer in model.layers if isinstance(layer, kvram.layers.Checkpoint)]
        assert names == [f"encoder_block{i}" for i in range(wrapped)]


def test_vit_patch_embedding_as_matmul_equals_the_conv():
    """The same weights give the same outputs and gradients, the matmul's kernel
    being the conv's reshaped."""
    x = np.random.default_rng(1).random((3, 32, 32, 3)).astype("float32")
    y = np.array([0, 1, 2])
    conv = vit_tiny(checkpoint=False)
    matmul = vit_tiny(checkpoint=False, patch_embedding_kind="matmul")
    assert conv.count_params() == matmul.count_params()
    weights = conv.get_weights()
    kernel = conv.get_layer("patch_embedding").kernel
    weights[0] = weights[0].reshape(-1, weights[0].shape[-1])  # (4, 4, 3, 64) -> (48, 64)
    assert kernel.path == conv.weights[0].path
    matmul.set_weights(weights)
    results = []
    for model in (conv, matmul):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        grads = tape.gradient(loss, model.trainable_weights)
        results.append([logits, grads[0].numpy().reshape(-1, grads[0].shape[-1])] + grads[1:])
    assert max_rel_diff(results[0][:1], results[1][:1]) < 1e-5
    assert max_rel_diff(results[0][1:], results[1][1:], per_tensor=False) < 1e-5


def test_vit_bad_arguments():
    with pytest.raises(ValueError, match="multiple of patch"):
        vit(image_size=30, patch=4)
    with pytest.raises(ValueError, match="'efficient' or 'keras'"):
        vit_tiny(attention="flash")
    with pytest.raises(ValueError, match="checkpoint must be True, False or an int from 0 to depth=4. Received: 5"):
        vit_tiny(checkpoint=5)
    with pytest.raises(ValueError, match="'conv' or 'matmul'"):
        vit_tiny(patch_embedding_kind="linear")


def _leaves(model):
    """The weight-holding layers of a model with nested sub-models, by name."""
    return {
        layer.name: layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not layer._layers and layer.weights
    }


def _resnet_step(model, reference, x, y):
    """The outputs and gradients of one training step of `model`, whose weights
    are first set to those of `reference` layer by layer (nesting differs, names
    do not), gradients listed by layer name; the optimized XLA HLO of the same
    step; and the step's peak CPU allocation beyond the weights."""
    leaves, source = _leaves(model), _leaves(reference)
    assert set(leaves) == set(source)
    for name, layer in leaves.items():
        for mine, theirs in zip(layer.weights, source[name].weights):
            mine.assign(theirs)
    variables = [w for name in sorted(leaves) for w in leaves[name].trainable_weights]

    def step(x):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, out))
        return [out] + tape.gradient(loss, variables)

    hlo = tf.function(step, jit_compile=True).experimental_get_compiler_ir(x)(stage="optimized_hlo")
    result, peak = run_with_peak(tf.function(step), x, warm=True, repeat=3)
    return result, hlo, peak


@pytest.mark.slow  # three XLA compiles
@pytest.mark.own_process
def test_resnet50_recomputing_batch_norm_and_relu_only(request):
    """`recompute=`: same function and gradients, less memory than keeping
    everything, and (under XLA) not one convolution more than no recomputation,
    where checkpointing whole blocks recomputes their convolutions. On ResNet50's
    parts with fewer blocks (`blocks=(2, 1, 1, 1)`: the stem, identity and
    projection shortcuts, every stage): 32 CPU-s instead of ~63 on 2 cores; peaks
    here 156.8 (plain), 135.3 (selective), 120.5 MiB (full).

    Its own process: in the suite's, allocations of earlier tests' threads land
    in the same CPU allocator's peak (CI, batch 16: selective 171.6 vs plain
    174.5 MiB; 158.8 vs 183.1 in a process of its own here)."""
    from models.resnet50 import resnet50

    if in_own_process(request):
        return
    # Batch 32: the gradients are in every peak; at 16 (ResNet50's 94 MB of them) the activations
    # selective recomputation saves were within the executor's order-to-order spread.
    x = tf.constant(np.random.default_rng(0).random((32, 64, 64, 3)).astype("float32"))
    y = np.arange(32) % 10
    keras.utils.set_random_seed(0)
    blocks = (2, 1, 1, 1)
    plain = resnet50((64, 64, 3), classes=10, checkpoint=False, blocks=blocks)
    runs = {
        name: _resnet_step(resnet50((64, 64, 3), classes=10, blocks=blocks, **kwargs), plain, x, y)
        for name, kwargs in {
            "plain": dict(checkpoint=False),
            "selective": dict(checkpoint=False, recompute=True),
            "full": dict(checkpoint=True),
        }.items()
    }
    for name in ("selective", "full"):
        assert max_rel_diff(runs["plain"][0][:1], runs[name][0][:1]) < 1e-5
        assert max_rel_diff(runs["plain"][0][1:], runs[name][0][1:], per_tensor=False) < 1e-5
    convolutions = {name: len(re.findall(r"= \S+ convolution\(", run[1])) for name, run in runs.items()}
    assert convolutions["selective"] == convolutions["plain"] < convolutions["full"], convolutions
    peaks = {name: run[2] for name, run in runs.items()}
    print({name: f"{peak / 2**20:.1f} MiB" for name, peak in peaks.items()})
    assert peaks["full"] < peaks["selective"] < 0.95 * peaks["plain"], peaks


def test_resnet50_without_conv_biases_is_torchvision_resnet50_sized():
    from models.resnet50 import resnet50

    model = resnet50(checkpoint=(), conv_bias=False)
    # torchvision.models.resnet50()'s parameters (its BatchNorm running statistics are buffers)
    assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == 25_557_032
    assert resnet50(checkpoint=()).count_params() == 25_636_712  # keras.applications.ResNet50(weights=None)


def test_resnet50_bad_parts():
    from models.resnet50 import resnet50

    with pytest.raises(ValueError, match=r"Unknown ResNet50 parts \[6\]; allowed"):
        resnet50((32, 32, 3), classes=10, recompute=(6,))
    with pytest.raises(ValueError, match=r"blocks must be 4 positive ints, one per stage. Received: \(3, 4\)"):
        resnet50((32, 32, 3), classes=10, blocks=(3, 4))
    with pytest.raises(ValueError, match=r"Received: \(1, 0, 1, 1\)"):
        resnet50((32, 32, 3), classes=10, blocks=(1, 0, 1, 1))
