"""Deferred weight gradients for `PipelineModel` (Zero Bubble's B/W split): each
Dense kernel's gradient is one product over all slices after their backward
passes, instead of one per slice, written and added."""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from kvram.layers import Checkpoint
from kvram.layers.checkpoint import dense_epilogue


class DeferredKernels:
    """Zero Bubble's B/W split (Qi et al. 2023, "Zero Bubble Pipeline
    Parallelism") for the `keras.layers.Dense` layers of the stages.

    Within `deferring()`, each such layer's product with its kernel has a
    gradient that gives the input gradient only (dy @ kernel^T) and records
    the product's input and output gradient; `gradients(k)` then gives each of
    stage k's kernels its gradient over every recorded slice at once,
    concat(inputs)^T @ concat(output gradients): one matrix product over the
    whole batch in place of one per slice (a reduction over a slice's rows
    only) and the additions of their results.
    """

    def __init__(self, stages, enabled=True):
        self.layers = [_deferrable_dense(stage) if enabled else [] for stage in stages]
        self.records: dict = {}

    @contextlib.contextmanager
    def deferring(self):
        layers = [layer for stage in self.layers for layer in stage]
        for layer in layers:
            self.records[id(layer)] = []
            # An instance attribute, so Keras's Layer.__call__ calls it; set
            # past Keras's attribute tracking, and removed after.
            object.__setattr__(layer, "call", self._call(layer))
        try:
            yield
        finally:
            for layer in layers:
                object.__delattr__(layer, "call")

    def _call(self, layer):
        records = self.records[id(layer)]

        def call(inputs, training=None):
            return dense_epilogue(layer, _deferred_matmul(inputs, tf.convert_to_tensor(layer.kernel), records))

        return call

    def gradients(self, k):
        """(kernel variable, its gradient summed over the slices) for stage k's
        layers whose products were recorded."""
        out = []
        for layer in self.layers[k]:
            records = self.records.get(id(layer))
            if not records:
                continue
            inputs, output_gradients = zip(*records)
            units_in, units_out = layer.kernel.shape
            flat_inputs = tf.reshape(tf.concat(inputs, 0), [-1, units_in])
            flat_gradients = tf.reshape(tf.concat(output_gradients, 0), [-1, units_out])
            gradient = tf.matmul(flat_inputs, flat_gradients, transpose_a=True)
            out.append((layer.kernel, tf.cast(gradient, layer.kernel.dtype)))
        return out


def _deferrable_dense(stage) -> list:
    """The `keras.layers.Dense` layers in `stage` (itself included) whose kernel
    gradient `_DeferredKernels` can take over: Keras's own `call`, trainable,
    no LoRA, not quantized, not inside a `kvram.layers.Checkpoint` (there the
    gradient is computed in the recomputation)."""
    found, queue, seen = [], [stage], set()
    while queue:
        layer = queue.pop(0)
        if id(layer) in seen or isinstance(layer, Checkpoint):
            continue
        seen.add(id(layer))
        if (
            isinstance(layer, keras.layers.Dense)
            and type(layer).call is keras.layers.Dense.call
            and layer.trainable
            and not layer.lora_enabled
            and not layer.quantization_mode
            and len(layer.kernel.shape) == 2
        ):
            found.append(layer)
        queue.extend(layer._flatten_layers(include_self=False, recursive=False))
    return found


def _deferred_matmul(inputs, kernel, records):
    """inputs @ kernel, whose gradient is the input gradient alone; (inputs,
    output gradient) is appended to `records` for the kernel's."""

    @tf.custom_gradient
    def product(x, w):
        def gradient(dy):
            records.append((x, dy))
            return tf.matmul(dy, tf.cast(w, dy.dtype), transpose_b=True), None

        return keras.ops.matmul(x, w), gradient

    return product(inputs, kernel)
