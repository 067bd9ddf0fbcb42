"""A language model's head and its sparse cross-entropy in one chunked op that
never holds the (tokens, vocabulary) logits: `kvram.speed.fused_cross_entropy`.

Per chunk of rows (tokens) it computes the chunk's logits (products in the
compute dtype with float32 results inside XLA, float32 elsewhere), their
float32 log-sum-exp, the loss, and at once the chunk's share of the gradients
of the hidden states and the bias (the way Liger-Kernel's
FusedLinearCrossEntropy does). The backward pass scales them and makes the
kernel's gradient a slice of the vocabulary at a time from the rows'
log-sum-exp, in the kernel's dtype: one more (rows, D) x (D, V) product, and
no (D, V) float32 tensor. Peak memory beyond the model: a few (chunk,
vocabulary) and (rows, slice) float32 buffers, the hidden states' float32
gradient and the kernel's gradient.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.losses import loss as loss_module
from tensorflow.compiler.tf2xla.python import xla
from tensorflow.python.eager import record

from kvram._order import in_xla
from kvram.layers._compiling import alone_in_xla
from kvram.layers.attention import _product

__all__ = ["linear_cross_entropy", "Head", "head_of", "REDUCTIONS"]

REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")


def linear_cross_entropy(hidden, kernel, labels, weights=None, bias=None, transposed=False, chunk_size=1024,
                         dtype=None):
    """sum over rows of w * (logsumexp(z) - z[label]), z = hidden @ kernel (+ bias).

    Args:
        hidden: (..., D) hidden states. kernel: (D, V), or (V, D) with
            `transposed` (a tied embedding). bias: None or (V,).
        labels: int (...), the target of each row, in [0, V).
        weights: None or float (...) (broadcast against `labels`).
        chunk_size: rows per chunk (int >= 1).
        dtype: the products' input dtype (None: `hidden`'s).

    Returns:
        The float32 weighted sum; its gradient reaches `hidden`, `kernel` and `bias`.
    """
    dtype = tf.as_dtype(dtype or hidden.dtype)
    d = hidden.shape[-1]
    labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
    rows = tf.shape(labels)[0]
    weights = tf.ones_like(labels, tf.float32) if weights is None else tf.reshape(
        tf.broadcast_to(tf.cast(weights, tf.float32), tf.shape(hidden)[:-1]), [-1])
    count = (rows + chunk_size - 1) // chunk_size
    padding = count * chunk_size - rows

    def chunks(x):
        x = tf.pad(x, [[0, padding]] + [[0, 0]] * (x.shape.rank - 1))
        return tf.reshape(x, tf.concat([[count, chunk_size], tf.shape(x)[1:]], 0))

    label_chunks, weight_chunks = chunks(labels), chunks(weights)
    inputs = [tf.convert_to_tensor(t) for t in [hidden, kernel] + ([] if bias is None else [bias])]

    def loop(h, w, b):
        """The chunks' loss, float32 gradients of `h` and `b` (None: no bias) and rows' log-sum-exp."""
        h_chunks = chunks(tf.reshape(h, [-1, d]))
        w_in = tf.cast(w, dtype)

        def body(j, total, dh, lses, db):
            h_c = tf.gather(h_chunks, j)
            z = _product(h_c, w_in, dtype, adj_b=transposed)  # (C, V) float32
            if b is not None:
                z = z + tf.cast(b, tf.float32)
            lse = tf.reduce_logsumexp(z, axis=-1)
            y, weight = tf.gather(label_chunks, j), tf.gather(weight_chunks, j)
            target = tf.gather(z, y, axis=1, batch_dims=1)
            total = total + tf.reduce_sum(weight * (lse - target))
            g = tf.exp(z - lse[:, None]) - tf.one_hot(y, tf.shape(z)[1], dtype=tf.float32)
            g = g * weight[:, None]
            dh = dh.write(j, _product(g, w_in, dtype, adj_b=not transposed))
            if b is not None:
                db = db + tf.reduce_sum(g, axis=0)
            return j + 1, total, dh, lses.write(j, lse), db

        _, total, dh, lses, db = tf.while_loop(
            lambda j, *_: j < count, body,
            (tf.constant(0), tf.constant(0.0), tf.TensorArray(tf.float32, size=count),
             tf.TensorArray(tf.float32, size=count), tf.zeros([vocabulary], tf.float32)),
            parallel_iterations=1,
        )
        dh = tf.reshape(tf.reshape(dh.stack(), [-1, d])[:rows], tf.shape(h))  # float32 until scaled
        return total, dh, tf.reshape(lses.stack(), [-1])[:rows], db

    vocabulary = kernel.shape[0] if transposed else kernel.shape[1]
    known_rows = hidden.shape[:-1].num_elements()
    # the kernel's gradient a slice of the vocabulary at a time: (rows, slice) float32 buffers about
    # as large as a chunk's (chunk, vocabulary) ones, a multiple of 128 columns where that is smaller
    columns = min(vocabulary, max(1, chunk_size * vocabulary // known_rows) if known_rows else chunk_size)
    columns = columns - columns % 128 if columns > 128 else columns
    dtypes = [t.dtype for t in inputs]

    def kernel_gradient(upstream, h, w, b, lse):
        """`upstream` times the kernel's gradient, in the kernel's dtype, made `columns` entries of the
        vocabulary at a time from the rows' log-sum-exp: no (D, V) float32 tensor (Llama-3-8B's head:
        2 GiB), one more (rows, D) x (D, V) product than keeping the gradient from the forward pass."""
        h = tf.reshape(h, [-1, d])
        upstream = tf.cast(upstream, tf.float32)

        def part(start, size):
            w_c = tf.slice(w, [start, 0], [size, d]) if transposed else tf.slice(w, [0, start], [d, size])
            z = _product(h, tf.cast(w_c, dtype), dtype, adj_b=transposed)  # (rows, size) float32
            if b is not None:
                z = z + tf.cast(tf.slice(b, [start], [size]), tf.float32)
            g = (tf.exp(z - lse[:, None]) - tf.one_hot(labels - start, size, dtype=tf.float32)) * weights[:, None]
            g_w = _product(g, h, dtype, adj_a=True) if transposed else _product(h, g, dtype, adj_a=True)
            return tf.cast(g_w * upstream, w.dtype)

        full, rest = divmod(vocabulary, columns)
        if in_xla(h):
            # written in place into one buffer of the kernel's shape and dtype
            def corner(start):
                return [start, 0] if transposed else [0, start]

            def body(j, out):
                return j + 1, xla.dynamic_update_slice(out, part(j * columns, columns), corner(j * columns))

            _, out = tf.while_loop(lambda j, _: j < full, body, (tf.constant(0), tf.zeros(w.shape, w.dtype)),
                                   parallel_iterations=1)
            return out if not rest else xla.dynamic_update_slice(out, part(full * columns, rest),
                                                                 corner(full * columns))
        _, parts = tf.while_loop(
            lambda j, _: j < full, lambda j, parts: (j + 1, parts.write(j, part(j * columns, columns))),
            (tf.constant(0), tf.TensorArray(w.dtype, size=full)), parallel_iterations=1)
        parts = parts.stack()  # (full, columns, D) or (full, D, columns)
        parts = (tf.reshape(parts, [-1, d]) if transposed
                 else tf.reshape(tf.transpose(parts, [1, 0, 2]), [d, full * columns]))
        return parts if not rest else tf.concat([parts, part(full * columns, rest)], 0 if transposed else 1)

    def backward(upstream, dh, db, h, w, b, lse):
        """The gradients of the inputs, in their dtypes (a bias's only where there is one)."""
        dw = kernel_gradient(upstream, h, w, b, lse)
        upstream = tf.cast(upstream, tf.float32)
        grads = [tf.cast(dh * upstream, dtypes[0]), dw]
        return grads if b is None else grads + [tf.cast(db * upstream, dtypes[2])]

    if alone_in_xla(hidden):
        # A step in TensorFlow's executor whose parts XLA compiles one by one (kvram.Model(host_offload=True)
        # with Checkpoint blocks): the loop, and the backward pass, are computations of their own too.
        # As TensorFlow ops the products run on float32 copies (`_product`): for Llama-3-8B's head
        # (4096 x 128256, 2 GiB in float32) that ran a 24 GiB GPU out of memory casting the kernel to
        # float32. Under XLA on a GPU the products take the kernel in bfloat16.
        loop = tf.function(loop, jit_compile=True, autograph=False)
        backward = tf.function(backward, jit_compile=True, autograph=False)

    @tf.custom_gradient
    def fused(*inputs):
        h, w = inputs[0], inputs[1]
        b = inputs[2] if bias is not None else None
        # Not recorded by outer tapes: this function's gradient is `grad`. In a
        # graph, a persistent tape that recorded the loop built the loop's own
        # gradient as it was traced, which fails on the bfloat16 products
        # (BatchMatMulV3 with a float32 result: its gradient is float32, the
        # cast's bfloat16) and would hold the loop's intermediates for nothing.
        with record.stop_recording():
            total, dh, lse, db = loop(h, w, b)

        def grad(upstream):
            return backward(upstream, dh, db, h, w, b, lse)

        return total, grad

    return fused(*inputs)


class Head:
    """The head of a functional model whose one output is its logits: a
    `Dense(vocabulary)` without activation, or a Keras/KerasHub
    `ReversibleEmbedding` called with `reverse=True` (tied or not), and the
    model that computes the head's input."""

    def __init__(self, model, layer, features, transposed, chunk_size):
        self.model, self.layer, self.features = model, layer, features
        self.transposed, self.chunk_size = transposed, chunk_size

    def kernel_and_bias(self):
        layer = self.layer
        if isinstance(layer, keras.layers.Dense):
            return layer.kernel, layer.bias
        return (layer.embeddings if layer.tie_weights else layer.reverse_embeddings), None

    def loss(self, x, y, sample_weight, training=True):
        """The model's compiled loss (and its added losses) from its hidden
        states, as Keras's `compute_loss` would reduce it from the logits."""
        model = self.model
        loss_fn = compiled_loss(model)
        hidden = self.features(x, training=training)
        kernel, bias = self.kernel_and_bias()
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight)
            while sample_weight.shape.rank is not None and sample_weight.shape.rank > y.shape.rank:
                sample_weight = tf.squeeze(sample_weight, -1)
        dtype = keras.config.dtype_policy().compute_dtype
        total = linear_cross_entropy(hidden, kernel, y, sample_weight, bias=bias, transposed=self.transposed,
                                     chunk_size=self.chunk_size, dtype=dtype)
        reduction = loss_fn.reduction
        if reduction in ("sum_over_batch_size", "mean"):
            total = total / tf.cast(tf.size(y), tf.float32)
        elif reduction == "mean_with_sample_weight":
            weights = tf.ones_like(y, tf.float32) if sample_weight is None else tf.broadcast_to(
                tf.cast(sample_weight, tf.float32), tf.shape(y))
            total = tf.math.divide_no_nan(total, tf.reduce_sum(weights))
        if reduction != "sum":
            total = loss_module.scale_loss_for_distribution(total)
        added = [model._aggregate_additional_loss(extra) for extra in model.losses]
        return tf.add_n([total] + [tf.cast(a, total.dtype) for a in added]) if added else total


def compiled_loss(model):
    """The model's compiled loss, if `fused_cross_entropy` can compute it:
    `SparseCategoricalCrossentropy(from_logits=True)` with a reduction it knows,
    no `ignore_class`; else a ValueError saying what was found."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        raise ValueError(
            f"fused_cross_entropy computes SparseCategoricalCrossentropy(from_logits=True); the model was compiled "
            f"with loss={loss!r}, which reads its predictions as probabilities. Compile with "
            "loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True).")
    if not isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        raise ValueError(
            "fused_cross_entropy computes keras.losses.SparseCategoricalCrossentropy(from_logits=True) from the "
            f"head's input; the model's compiled loss is {loss!r}. Compile with that loss first.")
    config = loss.get_config()
    if not config.get("from_logits"):
        raise ValueError("fused_cross_entropy needs SparseCategoricalCrossentropy(from_logits=True): the model's "
                         "head computes logits. Received: from_logits=False")
    if config.get("ignore_class") is not None:
        raise ValueError("fused_cross_entropy does not take ignore_class (Received: ignore_class="
                         f"{config['ignore_class']}); give the ignored tokens a sample_weight of 0 instead.")
    if loss.reduction not in REDUCTIONS:
        raise ValueError(f"fused_cross_entropy reduces as {REDUCTIONS}. Received: reduction={loss.reduction!r}")
    return loss


class _Node:
    """A head's call inside a part, with the outer tensor that feeds the part."""

    def __init__(self, node, outer_input):
        self.arguments, self.input_tensors = node.arguments, [outer_input]


def head_of(model, chunk_size) -> Head:
    """The model's head (see `Head`), or a ValueError saying why it has none."""
    from keras.src.models.functional import Functional

    if not isinstance(model, Functional) or len(model.outputs) != 1:
        raise ValueError(
            "fused_cross_entropy takes a functional Keras model with one output, its logits (a KerasHub "
            f"CausalLM, or keras.Model(inputs, Dense(vocabulary)(x))). Received: {type(model).__name__}"
            + ("" if not isinstance(model, Functional) else f" with {len(model.outputs)} outputs"))
    operation, node_index, _ = model.outputs[0]._keras_history
    node = operation._inbound_nodes[node_index]
    # A part of its own around the head (what remat.rebuild makes of a head
    # that is one segment of the chain): the head inside, the part's input its input
    while isinstance(operation, Functional) and len(operation.inputs) == 1 and len(operation.outputs) == 1:
        inner, inner_index, _ = operation.outputs[0]._keras_history
        inner_node = inner._inbound_nodes[inner_index]
        if len(inner_node.input_tensors) != 1 or inner_node.input_tensors[0] is not operation.inputs[0]:
            break
        operation, node = inner, _Node(inner_node, node.input_tensors[0])
    reversible = isinstance(operation, keras.layers.ReversibleEmbedding) and (
        node.arguments.kwargs.get("reverse") or (len(node.arguments.args) > 1 and node.arguments.args[1]))
    if isinstance(operation, keras.layers.Dense):
        if keras.activations.serialize(operation.activation) not in ("linear", None) and operation.activation not in (
                None, keras.activations.linear):
            raise ValueError(f"fused_cross_entropy needs the head without activation; {operation.name!r} has "
                             f"activation={keras.activations.serialize(operation.activation)!r}")
        transposed = False
    elif reversible:
        if operation.logit_soft_cap is not None:
            raise ValueError(f"fused_cross_entropy does not soft-cap logits; {operation.name!r} has "
                             f"logit_soft_cap={operation.logit_soft_cap}")
        transposed = bool(operation.tie_weights)
    else:
        raise ValueError(
            "fused_cross_entropy needs the model's output to come from a Dense(vocabulary) head or a "
            f"ReversibleEmbedding called with reverse=True. Received: {type(operation).__name__} "
            f"{operation.name!r}")
    if getattr(operation, "quantization_mode", None) is not None:
        raise ValueError(f"fused_cross_entropy does not take a quantized head ({operation.name!r}: "
                         f"{operation.quantization_mode})")
    hidden = node.input_tensors[0]
    features = keras.Model(model.inputs, hidden, name=f"{model.name}_features")
    return Head(model, operation, features, transposed, chunk_size)
