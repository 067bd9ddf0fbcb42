"""ResNet50 (v1) with each residual block a sub-model, optionally checkpointed.

Layer for layer the architecture of `keras.applications.ResNet50(weights=None)`
(same convolutions, biases, BatchNormalization epsilon, 25,636,712 parameters),
but every bottleneck block, and the stem, is its own `keras.Model`, so that it can
be wrapped in `kvram.layers.Checkpoint`.
"""

from __future__ import annotations

import keras
from keras import layers

import kvram

STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # filters, blocks, stride
BLOCKS = tuple(blocks for _, blocks, _ in STAGES)


def _recomputed(layers_, input_shape, name):
    """`layers_` applied in order, as one `kvram.layers.Checkpoint`: only its input
    is kept for the backward pass. Used for BatchNormalization -> ReLU -> next
    layer: the batch norm and ReLU are recomputed from the kept convolution
    output, and the next convolution's forward pass is not (its gradients need
    only its input and the incoming gradient, so graph pruning drops its
    recomputation)."""
    inputs = keras.Input(input_shape)
    x = inputs
    for layer in layers_:
        x = layer(x)
    return kvram.layers.Checkpoint(keras.Model(inputs, x, name=name))


def _bottleneck(input_shape, filters, stride, conv_shortcut, name, recompute=False, bias=True):
    inputs = keras.Input(input_shape)
    if conv_shortcut:
        shortcut = layers.Conv2D(4 * filters, 1, strides=stride, use_bias=bias, name=f"{name}_0_conv")(inputs)
        shortcut = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_0_bn")(shortcut)
    else:
        shortcut = inputs
    x = layers.Conv2D(filters, 1, strides=stride, use_bias=bias, name=f"{name}_1_conv")(inputs)
    units = [
        [
            layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_1_bn"),
            layers.Activation("relu", name=f"{name}_1_relu"),
            layers.Conv2D(filters, 3, padding="SAME", use_bias=bias, name=f"{name}_2_conv"),
        ],
        [
            layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_2_bn"),
            layers.Activation("relu", name=f"{name}_2_relu"),
            layers.Conv2D(4 * filters, 1, use_bias=bias, name=f"{name}_3_conv"),
        ],
    ]
    for i, unit in enumerate(units, start=1):
        if recompute:
            x = _recomputed(unit, tuple(x.shape[1:]), f"{name}_{i}_recompute")(x)
        else:
            for layer in unit:
                x = layer(x)
    x = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_3_bn")(x)
    x = layers.Add(name=f"{name}_add")([shortcut, x])
    x = layers.Activation("relu", name=f"{name}_out")(x)
    return keras.Model(inputs, x, name=name)


def _stem(input_shape, recompute=False, bias=True):
    inputs = keras.Input(input_shape)
    x = layers.ZeroPadding2D(3, name="conv1_pad")(inputs)
    x = layers.Conv2D(64, 7, strides=2, use_bias=bias, name="conv1_conv")(x)
    unit = [
        layers.BatchNormalization(epsilon=1.001e-5, name="conv1_bn"),
        layers.Activation("relu", name="conv1_relu"),
        layers.ZeroPadding2D(1, name="pool1_pad"),
        layers.MaxPooling2D(3, strides=2, name="pool1_pool"),
    ]
    if recompute:
        x = _recomputed(unit, tuple(x.shape[1:]), "conv1_recompute")(x)
    else:
        for layer in unit:
            x = layer(x)
    return keras.Model(inputs, x, name="stem")


ALL = ("stem", 2, 3, 4, 5)


def _parts(value):
    parts = ALL if value is True else tuple(value or ())
    unknown = [p for p in parts if p not in ALL]
    if unknown:
        raise ValueError(f"Unknown ResNet50 parts {unknown}; allowed: {list(ALL)}, True or ().")
    return parts


def resnet50(
    input_shape=(224, 224, 3), classes: int = 1000, checkpoint=ALL, recompute=(), conv_bias: bool = True,
    blocks=BLOCKS,
) -> keras.Model:
    """ResNet50 as a `kvram.Model`.

    Args:
        checkpoint: which parts are `kvram.layers.Checkpoint`s (only their inputs
            are kept for the backward pass): any of "stem" and the stage numbers
            2..5 (conv2_x .. conv5_x); True for all, False or () for none. Early
            stages hold most activation memory for the same FLOPs, so ("stem", 2, 3)
            saves most of the memory at about half the recomputation.
        recompute: parts (same names; True for all) that keep their
            convolution outputs but recompute each BatchNormalization and ReLU
            after them in the backward pass (selective recomputation: the cheap
            element-wise work, not the convolutions). A part in `checkpoint` is
            recomputed whole and ignores this.
        conv_bias: whether the convolutions have biases, as Keras's ResNet50
            has; without them (each is followed by a BatchNormalization, which
            subtracts it again while training) the model is torchvision's
            `resnet50`, 25,557,032 parameters.
        blocks: the bottleneck blocks of each of the four stages: ResNet50's
            (3, 4, 6, 3) by default; fewer make a smaller model of the same parts.
    """
    if len(blocks) != len(STAGES) or any(not isinstance(n, int) or n < 1 for n in blocks):
        raise ValueError(f"blocks must be {len(STAGES)} positive ints, one per stage. Received: {blocks!r}")
    parts = _parts(checkpoint)
    selective = _parts(recompute)

    def wrap(block, part):
        return kvram.layers.Checkpoint(block) if part in parts else block

    def cheap(part):
        return part in selective and part not in parts

    inputs = keras.Input(input_shape)
    x = wrap(_stem(input_shape, cheap("stem"), conv_bias), "stem")(inputs)
    for stage, ((filters, _, stride), count) in enumerate(zip(STAGES, blocks), start=2):
        for i in range(1, count + 1):
            block = _bottleneck(
                tuple(x.shape[1:]), filters, stride if i == 1 else 1, i == 1,
                name=f"conv{stage}_block{i}", recompute=cheap(stage), bias=conv_bias,
            )
            x = wrap(block, stage)(x)
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    outputs = layers.Dense(classes, activation="softmax", dtype="float32", name="predictions")(x)
    return kvram.Model(inputs, outputs, name="resnet50")
