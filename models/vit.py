"""Vision Transformer (ViT, Dosovitskiy et al. 2021) built from kvram parts.

`vit_b16()` is ViT-B/16 (patch 16, width 768, 12 blocks, 12 heads, MLP 3072,
pre-norm, GELU, class token, learned position embeddings): 86,567,656 parameters
at 224x224 and 1000 classes, the same count as torchvision's `vit_b_16`.
`vit_tiny()` is a small one for CPU tests and examples.

Every encoder block is its own `keras.Model`, so it can be wrapped in
`kvram.layers.Checkpoint`; its attention is `kvram.layers.MemoryEfficientAttention`
or, for a plain baseline, `keras.layers.MultiHeadAttention` (same weights).
"""

from __future__ import annotations

import keras
from keras import layers, ops

import kvram


@keras.saving.register_keras_serializable(package="kvram_models")
class ClassTokenAndPosition(layers.Layer):
    """Prepends a learned class token and adds learned position embeddings."""

    def build(self, input_shape):
        tokens, width = input_shape[1], input_shape[2]
        init = keras.initializers.RandomNormal(stddev=0.02)
        self.cls = self.add_weight(name="cls", shape=(1, 1, width), initializer="zeros")
        self.position = self.add_weight(name="position", shape=(1, tokens + 1, width), initializer=init)

    def call(self, x):
        cls = ops.broadcast_to(ops.cast(self.cls, x.dtype), (ops.shape(x)[0], 1, x.shape[-1]))
        return ops.concatenate([cls, x], axis=1) + ops.cast(self.position, x.dtype)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1] + 1, input_shape[2])


@keras.saving.register_keras_serializable(package="kvram_models")
class ClassToken(layers.Layer):
    """(B, tokens, width) -> (B, width): the class token's output."""

    def call(self, x):
        return x[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[2])


def patch_embedding(x, patch, width, kind="conv"):
    """(B, H, W, C) images -> (B, tokens, width) patch embeddings.

    kind="conv": a `Conv2D(width, patch, strides=patch)` as torchvision's
    `vit_b_16` has it. kind="matmul": the same product with the same weights
    (a `Dense` whose kernel is the conv's, reshaped to patch*patch*C x width),
    the image cut into patches by reshapes and a transpose: on an H200 cuDNN
    ran the conv (3 input channels) in 1.68 ms a step at batch 256 where the
    GEMM's FLOPs take under 0.1 ms (benchmarks/results/profile_vit_pair_h200.json).
    """
    height, wide, channels = x.shape[1], x.shape[2], x.shape[3]
    rows, cols = height // patch, wide // patch
    if kind == "conv":
        x = layers.Conv2D(width, patch, strides=patch, name="patch_embedding")(x)
        return layers.Reshape((rows * cols, width), name="patches")(x)
    if kind != "matmul":
        raise ValueError(f"`patch_embedding_kind` must be 'conv' or 'matmul'. Received: {kind!r}")
    x = layers.Reshape((rows, patch, cols, patch, channels), name="patch_grid")(x)
    x = layers.Permute((1, 3, 2, 4, 5), name="patch_order")(x)
    x = layers.Reshape((rows * cols, patch * patch * channels), name="patches")(x)
    return layers.Dense(width, name="patch_embedding")(x)


def encoder_block(tokens, width, heads, mlp, attention="efficient", chunk_size=512, dropout=0.0, name="block",
                  attention_implementation="auto"):
    """One pre-norm Transformer encoder block as a `keras.Model` (B, tokens, width) -> same."""
    if attention not in ("efficient", "keras"):
        raise ValueError(f"`attention` must be 'efficient' or 'keras'. Received: {attention!r}")
    inputs = keras.Input((tokens, width))
    x = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_ln1")(inputs)
    if attention == "efficient":
        attend = kvram.layers.MemoryEfficientAttention(
            heads, width // heads, chunk_size=chunk_size, dropout=dropout, name=f"{name}_attention",
            implementation=attention_implementation,
        )
    else:
        attend = layers.MultiHeadAttention(heads, width // heads, dropout=dropout, name=f"{name}_attention")
    x = attend(x, x)
    x = layers.Dropout(dropout, name=f"{name}_drop1")(x)
    x = layers.Add(name=f"{name}_add1")([inputs, x])
    y = layers.LayerNormalization(epsilon=1e-6, name=f"{name}_ln2")(x)
    y = layers.Dense(mlp, activation="gelu", name=f"{name}_mlp1")(y)
    y = layers.Dense(width, name=f"{name}_mlp2")(y)
    y = layers.Dropout(dropout, name=f"{name}_drop2")(y)
    outputs = layers.Add(name=f"{name}_add2")([x, y])
    return keras.Model(inputs, outputs, name=name)


def vit(
    image_size=224,
    patch=16,
    width=768,
    depth=12,
    heads=12,
    mlp=3072,
    classes=1000,
    channels=3,
    attention="efficient",
    checkpoint=True,
    chunk_size=512,
    dropout=0.0,
    name="vit",
    policy="full",
    attention_implementation="auto",
    patch_embedding_kind="conv",
) -> keras.Model:
    """A ViT as a `kvram.Model`.

    Args:
        attention: "efficient" (`MemoryEfficientAttention`) or "keras"
            (`keras.layers.MultiHeadAttention`).
        checkpoint: wrap every encoder block in `kvram.layers.Checkpoint`
            (True), none (False), or the first `checkpoint` blocks (an int
            from 0 to `depth`: the last blocks' activations, the first the
            backward pass frees, are kept).
        chunk_size: keys per chunk for the efficient attention.
        policy: the blocks' `Checkpoint` policy ("full" or "save_dots").
        attention_implementation: the efficient attention's `implementation`
            ("auto": cuDNN's fused attention in an XLA step on a GPU).
        patch_embedding_kind: "conv" or "matmul" (`patch_embedding`).
    """
    if image_size % patch:
        raise ValueError(f"image_size must be a multiple of patch. Received: {image_size}, {patch}")
    wrapped = depth if checkpoint is True else 0 if checkpoint is False else checkpoint
    if not isinstance(wrapped, int) or not 0 <= wrapped <= depth:
        raise ValueError(f"checkpoint must be True, False or an int from 0 to depth={depth}. Received: {checkpoint!r}")
    tokens = (image_size // patch) ** 2
    inputs = keras.Input((image_size, image_size, channels))
    x = patch_embedding(inputs, patch, width, patch_embedding_kind)
    x = ClassTokenAndPosition(name="class_and_position")(x)
    x = layers.Dropout(dropout, name="embedding_dropout")(x)
    for i in range(depth):
        block = encoder_block(
            tokens + 1, width, heads, mlp, attention, chunk_size, dropout, name=f"encoder_block{i}",
            attention_implementation=attention_implementation,
        )
        x = (kvram.layers.Checkpoint(block, policy=policy) if i < wrapped else block)(x)
    x = layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = ClassToken(name="class_token")(x)
    outputs = layers.Dense(classes, dtype="float32", name="head")(x)
    return kvram.Model(inputs, outputs, name=name)


def vit_b16(classes=1000, **kwargs) -> keras.Model:
    """ViT-B/16 at 224x224 (86.6 M parameters with 1000 classes)."""
    return vit(224, 16, 768, 12, 12, 3072, classes, name="vit_b16", **kwargs)


def vit_b16_plain(classes=1000, **kwargs) -> keras.Model:
    """ViT-B/16 without `Checkpoint` blocks: the model as a user brings it to
    `kvram plan --model models.vit:vit_b16_plain`."""
    return vit_b16(classes, checkpoint=False, **kwargs)


def vit_tiny(image_size=32, classes=10, **kwargs) -> keras.Model:
    """A small ViT for CPU tests: patch 4, width 64, 4 blocks of 4 heads."""
    kwargs = {"patch": 4, "width": 64, "depth": 4, "heads": 4, "mlp": 128, "name": "vit_tiny", **kwargs}
    return vit(image_size, classes=classes, **kwargs)
