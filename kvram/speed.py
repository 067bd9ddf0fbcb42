"""Faster training steps for any Keras model, without changing what it computes.

Measured on ResNet50 and ViT-B/16 against PyTorch in `benchmarks/profile/` and
`benchmarks/resnet50/`; each switch here leaves the model's outputs and
gradients unchanged within float rounding (tests/test_speed.py).
"""

from __future__ import annotations

import keras

from kvram import _einsum
from kvram._env import switched_off
from kvram.layers import attention
from kvram.layers.batch_norm import FusedBatchNormalization
from kvram.layers.lean import LeanLayerNormalization, lean_gelu, lean_gelu_approximate, lean_silu, make_lean_rms_norm

__all__ = [
    "efficient_attention", "fuse_batch_norm", "fused_cross_entropy", "lean_activations", "pin_host_memory",
    "host_memory_pinned",
    "tensordot_einsum",
]

# `import kvram` pins host memory on a machine with a GPU unless this is "0".
PIN_ENV = "KVRAM_PIN_HOST_MEMORY"
# `import kvram` routes Keras's einsum of a tensor times a weight through tf.tensordot unless this is "0".
TENSORDOT_ENV = "KVRAM_TENSORDOT_EINSUM"


def tensordot_einsum(enable: bool = True) -> bool:
    """Computes Keras's `einsum` of a tensor times a weight (`EinsumDense`:
    the projections of `MultiHeadAttention` and of KerasHub's models) as one
    2-D matmul, so that the weight's gradient is one GEMM (`enable=True`, what
    `import kvram` does unless the environment variable KVRAM_TENSORDOT_EINSUM
    is "0"), or as Keras does (`enable=False`).

    Keras 3.15 on TensorFlow computes `btd,dnh->btnh` as a `BatchMatMulV2`
    that broadcasts the weight, whose gradient for the weight is B products
    and a sum over them (the bug keras-team/keras#22823 fixed for `Dense`
    only). ViT-B/16 at batch 256 on an H200: 3233 img/s against 2989, in one
    call (benchmarks/results/vit_tensordot_h200.json). Values equal
    Keras's within float summation order (tests/test_einsum.py). Affects
    every Keras model in the process, traced after the call.

    Returns:
        Whether this changed anything.
    """
    return _einsum.install() if enable else _einsum.uninstall()


def pin_host_memory() -> None:
    """Allocates TensorFlow's CPU tensors in page-locked (pinned) memory, so that
    batches reach the GPU by asynchronous DMA instead of a staged copy.

    Without it, every batch that `tf.data` makes on the CPU is pageable memory:
    the CUDA driver copies it through a bounce buffer at a fraction of the bus
    speed (about 7 GB/s on an H200 host, 22 ms for a 256-image float32 batch), and
    the profile shows the GPU's compute stream waiting for most of that copy, so
    `kvram.Model`'s `prefetch_to_gpu` cannot hide it behind the previous step;
    pinned, it takes 3 ms (`benchmarks/profile/`). This sets TF's
    `GPUOptions.force_gpu_compatible`, the option TensorFlow's own
    `tf_cnn_benchmarks` turn on; TF 2 has no public call for it.

    `import kvram` calls it where TensorFlow sees a GPU (`pins_by_default`;
    KVRAM_PIN_HOST_MEMORY=0 leaves host memory pageable). Otherwise call it at
    program start, before TensorFlow runs its first operation (it configures the
    runtime, which starts once). Pinned memory comes from TF's
    host allocator, capped at 64 GiB unless `TF_GPU_HOST_MEM_LIMIT_IN_MB` says
    otherwise; tensors made from numpy arrays are not affected. Without a GPU
    the option does nothing. Calling it again is harmless.

    Raises:
        RuntimeError: TensorFlow's runtime has already started without it (the
            message says what to move).
    """
    if host_memory_pinned():
        return

    def pin(config):
        config.gpu_options.force_gpu_compatible = True

    _configure_runtime(
        pin,
        "kvram.speed.pin_host_memory() must run before TensorFlow's first operation: "
        "the runtime has already started with pageable host memory (force_gpu_compatible="
        "False). Call it right after the imports, before building a model or a dataset.",
    )


def _configure_runtime(change, too_late: str) -> None:
    """Applies `change(config)` to the `ConfigProto` TensorFlow's runtime will
    start with (TF 2 has no public call for most of its options), keeping what
    was set before. Raises RuntimeError(`too_late`) once the runtime has started."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx._initialized:
        raise RuntimeError(too_late)
    config = config_pb2.ConfigProto()
    if ctx._config is not None:
        config.CopyFrom(ctx._config)
    change(config)
    ctx._config = config


def pins_by_default(environ=None, gpus=None, started=None) -> bool:
    """Whether `import kvram` pins host memory (`pin_host_memory()`): where TensorFlow sees a
    GPU, its runtime has not started yet, and KVRAM_PIN_HOST_MEMORY is not "0". Without it a
    pageable batch kept the H200 waiting 23.7 ms a ResNet50 step against 7.5 ms pinned, and
    pinning alone made kvram's ResNet50 step 1.17x faster and plain Keras's 1.30x
    (benchmarks/results/resnet50_pinned_h200.json). The arguments stand in for the process's
    own state in tests."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    if switched_off(PIN_ENV, environ):
        return False
    started = context.context()._initialized if started is None else started
    if started:  # too late: the runtime keeps the configuration it started with
        return False
    gpus = tf.config.list_physical_devices("GPU") if gpus is None else gpus
    return bool(gpus)


def host_memory_pinned() -> bool:
    """Whether `pin_host_memory()` is in effect in this process."""
    from kvram import memory

    return memory._host_memory_pinned()


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

    def fuse(layer):
        if type(layer) is keras.layers.BatchNormalization:
            layer.__class__ = FusedBatchNormalization
            return True
        return False

    return _switch_each("fuse_batch_norm", model, fuse)


def _switch_each(name: str, model, switch) -> int:
    """Calls `switch(layer)` on `model` and every layer in it (nested ones,
    and inside `kvram.layers.Checkpoint`, included); how many it switched (it
    returns True for those). Functions Keras had traced for `model` are
    dropped when any was, so the next `fit`, `evaluate` or `predict` traces
    again. TypeError, naming the public function `name`, unless `model` is a
    Keras layer or model."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"{name} expects a Keras model or layer. Received: model={model!r}")
    switched = 0
    for layer in model._flatten_layers(include_self=True, recursive=True):
        switched += bool(switch(layer))
    if switched and isinstance(model, keras.Model):
        model.train_function = model.test_function = model.predict_function = None
    return switched


def _kerashub_approximate_gelu() -> dict:
    """{KerasHub's tanh-approximated GELU: lean_gelu_approximate} where
    KerasHub is imported (a model built with it has imported it), else {}."""
    import sys

    utils = sys.modules.get("keras_hub.src.utils.keras_utils")
    function = getattr(utils, "gelu_approximate", None)
    return {function: lean_gelu_approximate} if function is not None else {}


def _kerashub_llama_classes() -> tuple:
    """(KerasHub's LlamaLayerNorm, LlamaTransformerDecoder), each None where
    KerasHub's Llama is not imported (a model built with it has imported it)."""
    import sys

    norm = sys.modules.get("keras_hub.src.models.llama.llama_layernorm")
    decoder = sys.modules.get("keras_hub.src.models.llama.llama_decoder")
    return getattr(norm, "LlamaLayerNorm", None), getattr(decoder, "LlamaTransformerDecoder", None)


def lean_activations(model: keras.layers.Layer) -> int:
    """Makes the exact GELUs and the LayerNormalizations of `model` keep only
    their inputs for the backward pass, in place (`kvram.layers.lean`).

    Every `Dense` or `EinsumDense` whose activation is
    `keras.activations.gelu` (`activation="gelu"`) gets `lean_gelu`, one whose
    activation is KerasHub's tanh-approximated GELU (GPT-2's feedforward) gets
    `lean_gelu_approximate`, and every
    `keras.layers.LayerNormalization` becomes a `LeanLayerNormalization` (same
    weights and configuration). Outputs are unchanged, except that the exact
    GELU of a bfloat16/float16 input is computed in float32 and rounded once,
    as PyTorch does (within a rounding of Keras's and nearer the true value;
    ViT-B at batch 256 on an H200: 3292 img/s against 3233, two calls on one
    machine, benchmarks/results/vit_tensordot_h200_run*.json at commit 1fb3fe3); gradients agree within
    float rounding (tests/test_speed.py). Memory: a ViT-B block at batch 256
    kept 886 MB of GELU intermediates and two float32 copies for its
    LayerNormalizations (benchmarks/results/vit_buffers_h200.json). Works on
    any model, inside `kvram.layers.Checkpoint` too; call it before training.
    Saved models record `kvram>lean_gelu` and `kvram>LeanLayerNormalization`:
    `import kvram` is all that loading them needs.

    KerasHub's Llama blocks (`LlamaBackbone`, `LlamaCausalLM`): every
    `LlamaLayerNorm` (RMS normalisation) keeps its 16-bit input and one float32
    value per row instead of float32 copies of its input and output
    (`kvram.layers.lean.lean_rms_norm`; its class and saved configuration stay),
    and each feedforward's SwiGLU gate keeps its 16-bit input instead of a
    float32 copy: the gate's `Dense` gets `lean_silu` (SiLU in float32, rounded
    once, as KerasHub computes it) and the block's own activation becomes
    linear (a saved model records both). The same values; gradients within
    float rounding; in a traced bfloat16 step, the float32 bytes kept for the
    backward pass drop by the gates' and norms' copies (tests/test_speed.py).
    Under XLA, XLA may drop those copies itself: a two-block Llama (hidden 128,
    intermediate 1024, batch 32 x 64) compiled with `jit_compile=True` on the
    CPU peaked at 132.0 MiB with and without; on a GPU it is not measured yet.

    Returns:
        How many layers were switched.

    Raises:
        TypeError: `model` is not a Keras layer or model.
    """
    leans = {keras.activations.gelu: lean_gelu, **_kerashub_approximate_gelu()}
    rms_norm, llama_decoder = _kerashub_llama_classes()

    def make_lean(layer):
        if type(layer) is keras.layers.LayerNormalization:
            layer.__class__ = LeanLayerNormalization
            return True
        if rms_norm is not None and type(layer) is rms_norm and not getattr(layer, "_kvram_lean", False):
            make_lean_rms_norm(layer)
            layer._kvram_lean = True
            return True
        if llama_decoder is not None and isinstance(layer, llama_decoder):
            gate = layer._feedforward_gate_dense
            # LlamaBackbone passes keras.ops.silu; a block built alone defaults to "silu"
            silu = layer.activation is keras.activations.silu or layer.activation is keras.ops.silu
            if silu and gate.activation is keras.activations.linear:
                gate.activation, layer.activation = lean_silu, keras.activations.linear
                return True
            return False
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            lean = leans.get(getattr(layer, "activation", None))
            if lean is not None:
                layer.activation = lean
                return True
        return False

    return _switch_each("lean_activations", model, make_lean)


def _kerashub_attention_classes() -> tuple:
    """(KerasHub's grouped-query attention classes, its decoder blocks whose
    causal mask `attention.split_causal_mask` splits off); empty without KerasHub."""
    try:
        from keras_hub.src.layers.modeling.transformer_decoder import TransformerDecoder
        from keras_hub.src.models.llama.llama_attention import LlamaAttention
        from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder
    except ImportError:
        return (), ()
    return (LlamaAttention,), (TransformerDecoder, LlamaTransformerDecoder)


def efficient_attention(model: keras.layers.Layer, chunk_size: int = 512, implementation: str = "auto") -> int:
    """Makes every `keras.layers.MultiHeadAttention` in `model` compute its
    attention as `kvram.layers.MemoryEfficientAttention` does, in place:
    subclasses included (KerasHub's `CachedMultiHeadAttention`, in its GPT-2,
    OPT and Bart models), which a swap of classes could not reach, and
    KerasHub's `LlamaAttention` (grouped-query attention: cuDNN takes the keys
    and values at their own number of heads). In KerasHub's decoder blocks
    (`TransformerDecoder`, `LlamaTransformerDecoder`) the causal part of the
    self-attention mask goes to cuDNN as its causal kernel, the padding part as
    a bias (`kvram.layers.attention.split_causal_mask`). Gemma's attention
    (soft-capped logits, sliding windows) is left as it is.

    The n x n attention scores are never kept: cuDNN's fused attention where
    it runs (see `MemoryEfficientAttention`), else chunks of `chunk_size` keys
    with a running softmax, attention masks and dropout included. Outputs and
    gradients equal the layer's own within float rounding (tests/test_speed.py);
    with attention dropout while training, the dropped positions are drawn
    differently (from the layer's own seed generator). Each layer keeps its
    class, weights and configuration, so a saved model records the layers as
    they were: call this again after loading. Call it before training.

    Args:
        model: a Keras model or layer.
        chunk_size: keys per chunk (int >= 1).
        implementation: "auto", "chunked" or "cudnn", as `MemoryEfficientAttention`.

    Returns:
        How many layers were switched (layers already switched, and
        `MemoryEfficientAttention` layers, are not counted).

    Raises:
        TypeError: `model` is not a Keras layer or model.
        ValueError: `chunk_size` or `implementation` is not allowed.
    """

    attention.check_arguments(chunk_size, implementation)  # before any layer is looked at
    grouped, decoders = _kerashub_attention_classes()

    def make_efficient(layer):
        if isinstance(layer, decoders) and not hasattr(layer, "_kvram_split"):
            inner = getattr(layer, "_self_attention_layer", None)
            if inner is not None:
                attention.split_causal_mask(layer, inner)
                layer._kvram_split = True
        if hasattr(layer, "_kvram_efficient") or isinstance(layer, attention.MemoryEfficientAttention):
            return False
        if isinstance(layer, keras.layers.MultiHeadAttention):
            attention.make_efficient(layer, chunk_size, implementation)
            return True
        if isinstance(layer, grouped):
            attention.make_efficient_grouped(layer, chunk_size, implementation)
            return True
        return False

    return _switch_each("efficient_attention", model, make_efficient)


def fused_cross_entropy(model: keras.Model, chunk_size: int = 1024) -> int:
    """Makes `model` train with its head and its sparse cross-entropy fused
    into one chunked op that never holds the (tokens, vocabulary) logits, in
    place: for a functional model whose one output is a `Dense(vocabulary)`
    head without activation, or a `ReversibleEmbedding` called with
    `reverse=True` (KerasHub's `GPT2CausalLM`, `LlamaCausalLM`: tied or not),
    compiled with `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`.

    Each chunk of `chunk_size` tokens computes its logits (products in the
    global policy's compute dtype, bfloat16 under `mixed_bfloat16`, with float32
    results; float32 under `float32`), their float32 log-sum-exp and loss, and
    its share of the hidden states' gradient at once; the backward pass makes
    the kernel's gradient a slice of the vocabulary at a time, in the kernel's
    dtype, with no (hidden, vocabulary) float32 tensor. Loss and gradients equal Keras's own
    (sample weights and the loss's reduction included) within float rounding
    (tests/test_cross_entropy.py). Only training changes: `predict`,
    `evaluate`, `generate` and saving compute the logits as before.

    Training computes no logits, so training steps log the loss alone (with a
    warning where metrics were compiled: a KerasHub `CausalLM` compiles
    `SparseCategoricalAccuracy`); `evaluate()` and validation compute every
    compiled metric as before. Call it after `compile()` (the loss is checked
    then), and again after compiling or loading anew.

    Returns:
        1 (the head switched).

    Raises:
        ValueError: the model has no such head, is not compiled with that
            loss, or `chunk_size` is not an int >= 1.
    """
    from kvram import _checks
    from kvram.layers import _cross_entropy
    chunk_size = _checks.positive_int("chunk_size", chunk_size)
    if not isinstance(model, keras.Model):
        raise TypeError(f"fused_cross_entropy expects a Keras model. Received: model={model!r}")
    if not getattr(model, "compiled", False):
        raise ValueError("fused_cross_entropy checks the compiled loss: call model.compile(...) first.")
    _cross_entropy.compiled_loss(model)
    if model._compile_metrics is not None:
        import warnings

        warnings.warn(
            "fused_cross_entropy trains without logits, so training steps log the loss alone; the compiled "
            "metrics are computed by evaluate() and on validation data as before.", stacklevel=2)
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    aware = getattr(type(model), "_kvram_fused_head_aware", False)  # kvram.Model's step computes the head's loss
    if not aware and type(model).train_step is not TensorFlowTrainer.train_step:
        raise ValueError(f"fused_cross_entropy replaces Keras's own train_step, and {type(model).__name__} "
                         "overrides it: move the custom logic into call() or compute_loss().")
    head = _cross_entropy.head_of(model, chunk_size)
    model._kvram_fused_head = head
    if not aware:
        model.train_step = _fused_train_step(model, head)
    model.train_function = None
    return 1


def _fused_train_step(model, head):
    """Keras's `TensorFlowTrainer.train_step` with the fused loss in place of
    the logits and `compute_loss` (for a model that is not a `kvram.Model`)."""
    import tensorflow as tf
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import data_adapters

    def train_step(data):
        x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = head.loss(x, y, sample_weight)
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss), sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        if model.trainable_weights:
            gradients = tape.gradient(loss, model.trainable_weights)
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        return {"loss": model._loss_tracker.result()}

    return train_step
