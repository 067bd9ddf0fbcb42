"""Faster training steps for any Keras model, without changing what it computes.

Measured on ResNet50 and ViT-B/16 against PyTorch in `benchmarks/profile/` and
`benchmarks/resnet50/`; each switch here leaves the model's outputs and
gradients unchanged within float rounding (tests/test_speed.py).
"""

from __future__ import annotations

import keras

from kvram.layers.batch_norm import FusedBatchNormalization

__all__ = ["fuse_batch_norm"]


def fuse_batch_norm(model: keras.layers.Layer) -> int:
    """Makes every `keras.layers.BatchNormalization` in `model` a
    `kvram.layers.FusedBatchNormalization`, in place.

    Works on any model (functional, sequential, subclassed, nested, inside
    `kvram.layers.Checkpoint`): each layer keeps its weights, configuration and
    place in the graph, and only its computation changes (the class of the
    layer object becomes the fused subclass). Call it before training starts;
    functions Keras had already traced are dropped so that the next `fit`,
    `evaluate` or `predict` traces again.

    Args:
        model: a Keras model or layer.

    Returns:
        How many layers were switched.

    Raises:
        TypeError: `model` is not a Keras layer or model.

    Example:
        model = keras.applications.ResNet50(weights=None)
        kvram.speed.fuse_batch_norm(model)   # 53 layers
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"fuse_batch_norm expects a Keras model or layer. Received: model={model!r}"
        )
    switched = 0
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if type(layer) is keras.layers.BatchNormalization:
            layer.__class__ = FusedBatchNormalization
            switched += 1
    if switched and isinstance(model, keras.Model):
        model.train_function = model.test_function = model.predict_function = None
    return switched
