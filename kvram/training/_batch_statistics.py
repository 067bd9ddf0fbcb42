"""Layers whose training output depends on the other rows of their batch, and
how small a slice of a batch may be for them (`kvram.Model.micro_batch_size`,
`AdaptiveBatchSize`).

BatchNormalization normalises each value with the mean and variance of its
batch. Sliced into micro-batches, it sees each slice's statistics instead of
the batch's: with few rows they are noisy, and where a layer normalises over
the batch axis alone (its input is (batch, features), as after a Dense) a
slice of one row has a variance of 0 and a mean equal to the row, so the
layer's output is its `beta`, whatever the input: nothing before it learns.
Measured (Dense -> BatchNormalization -> ReLU -> Dense, `micro_batch_size=1`):
the loss stayed at ln 2 for 8 epochs and the first kernel never changed.

A leaf module: it imports Keras and nothing of kvram's.
"""

from __future__ import annotations

import math
import warnings

import keras

# Below this many rows a slice's batch statistics are noisy: Wu & He, "Group
# Normalization" (2018), Figure 1: ResNet-50's ImageNet error with BN rises
# from 23.6% at 32 images per worker to 27.3% at 8 and 34.7% at 2.
SMALL_SLICE = 8


def batch_statistic_layers(model) -> list:
    """(layer, values per row) for each layer of `model` (nested ones too) that
    normalises with its batch's statistics when trained: a trainable
    `BatchNormalization` not called with `training=False`. "Values per row" is
    how many values of one row each of its statistics is taken over (the
    product of the reduced axes but the batch's: 1 after a Dense, H*W after a
    convolution), None where the layer is not built or a size is unknown."""
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, keras.layers.BatchNormalization) or not layer.trainable:
            continue
        nodes = getattr(layer, "_inbound_nodes", [])
        if nodes and all(n.arguments.kwargs.get("training") is False for n in nodes):
            continue  # frozen in the graph: it uses its moving statistics
        found.append((layer, _values_per_row(layer)))
    return found


def _values_per_row(layer) -> int | None:
    shapes = getattr(layer, "_build_shapes_dict", None)
    axes = getattr(layer, "_reduction_axes", None)
    if not shapes or axes is None:
        return None
    shape = next(iter(shapes.values()))
    sizes = [shape[a] for a in axes if a != 0]
    if any(s is None for s in sizes):
        return None
    return math.prod(sizes)


def least_rows(model) -> int:
    """The fewest rows a slice of a batch may have for `model`'s batch
    statistics to carry anything: 2 where a layer normalises over the batch
    axis alone (one row would make its output constant), else 1."""
    return 2 if any(per_row == 1 for _, per_row in batch_statistic_layers(model)) else 1


def check_slices(model, micro_batch_size: int, rows: int | None = None, said: set | None = None) -> None:
    """Refuses slices that make a batch-statistics layer's output constant, and
    warns (once per reason, kept in `said`) about slices too small for good
    statistics.

    Raises:
        ValueError: `micro_batch_size` is 1 and a layer normalises over the batch
            axis alone.
    """
    layers = batch_statistic_layers(model)
    if not layers:
        return
    said = set() if said is None else said
    constant = [layer.name for layer, per_row in layers if per_row == 1]
    if micro_batch_size == 1 and constant:
        raise ValueError(
            f"micro_batch_size=1 trains each row alone, and BatchNormalization layer(s) {constant} "
            "normalise over the batch axis alone (a (batch, features) input): over one row their "
            "output is their beta, whatever the input, so no layer before them learns. Use "
            "micro_batch_size >= 2 (the larger, the closer to whole batches), or replace them "
            "with LayerNormalization or GroupNormalization, which do not use the batch. "
            f"Received: micro_batch_size={micro_batch_size}"
        )
    if rows is not None and constant and rows > 1 and rows % micro_batch_size == 1 and "last" not in said:
        said.add("last")
        warnings.warn(
            f"A batch of {rows} rows at micro_batch_size={micro_batch_size} leaves a last slice of "
            f"one row: BatchNormalization layer(s) {constant} normalise it to a constant, so that row "
            "adds nothing to the gradients of the layers before them. Pick a micro_batch_size that "
            f"leaves no one-row slice (one dividing {rows}), or batches of another size.",
            stacklevel=2,
        )
    if micro_batch_size < SMALL_SLICE and "small" not in said:
        said.add("small")
        names = [layer.name for layer, _ in layers]
        warnings.warn(
            f"micro_batch_size={micro_batch_size}: BatchNormalization layer(s) {names[:5]}"
            f"{' ...' if len(names) > 5 else ''} take their statistics over each slice of "
            f"{micro_batch_size} rows, not over the whole batch; under {SMALL_SLICE} rows they are "
            "noisy and training differs from whole batches. Use larger slices, or "
            "GroupNormalization/LayerNormalization instead.",
            stacklevel=2,
        )
