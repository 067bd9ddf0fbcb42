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


def _bottleneck(input_shape, filters, stride, conv_shortcut, name):
    inputs = keras.Input(input_shape)
    if conv_shortcut:
        shortcut = layers.Conv2D(4 * filters, 1, strides=stride, name=f"{name}_0_conv")(inputs)
        shortcut = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_0_bn")(shortcut)
    else:
        shortcut = inputs
    x = layers.Conv2D(filters, 1, strides=stride, name=f"{name}_1_conv")(inputs)
    x = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_1_bn")(x)
    x = layers.Activation("relu", name=f"{name}_1_relu")(x)
    x = layers.Conv2D(filters, 3, padding="SAME", name=f"{name}_2_conv")(x)
    x = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_2_bn")(x)
    x = layers.Activation("relu", name=f"{name}_2_relu")(x)
    x = layers.Conv2D(4 * filters, 1, name=f"{name}_3_conv")(x)
    x = layers.BatchNormalization(epsilon=1.001e-5, name=f"{name}_3_bn")(x)
    x = layers.Add(name=f"{name}_add")([shortcut, x])
    x = layers.Activation("relu", name=f"{name}_out")(x)
    return keras.Model(inputs, x, name=name)


def _stem(input_shape):
    inputs = keras.Input(input_shape)
    x = layers.ZeroPadding2D(3, name="conv1_pad")(inputs)
    x = layers.Conv2D(64, 7, strides=2, name="conv1_conv")(x)
    x = layers.BatchNormalization(epsilon=1.001e-5, name="conv1_bn")(x)
    x = layers.Activation("relu", name="conv1_relu")(x)
    x = layers.ZeroPadding2D(1, name="pool1_pad")(x)
    x = layers.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    return keras.Model(inputs, x, name="stem")


ALL = ("stem", 2, 3, 4, 5)


def resnet50(
    input_shape=(224, 224, 3), classes: int = 1000, checkpoint=ALL
) -> keras.Model:
    """ResNet50 as a `kvram.Model`.

    Args:
        checkpoint: which parts are `kvram.layers.Checkpoint`s (only their inputs
            are kept for the backward pass): any of "stem" and the stage numbers
            2..5 (conv2_x .. conv5_x); True for all, False or () for none. Early
            stages hold most activation memory for the same FLOPs, so ("stem", 2, 3)
            saves most of the memory at about half the recomputation.
    """
    parts = ALL if checkpoint is True else tuple(checkpoint or ())

    def wrap(block, part):
        return kvram.layers.Checkpoint(block) if part in parts else block

    inputs = keras.Input(input_shape)
    x = wrap(_stem(input_shape), "stem")(inputs)
    for stage, (filters, blocks, stride) in enumerate(STAGES, start=2):
        for i in range(1, blocks + 1):
            block = _bottleneck(
                tuple(x.shape[1:]), filters, stride if i == 1 else 1, i == 1,
                name=f"conv{stage}_block{i}",
            )
            x = wrap(block, stage)(x)
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    outputs = layers.Dense(classes, activation="softmax", dtype="float32", name="predictions")(x)
    return kvram.Model(inputs, outputs, name="resnet50")
