"""`MemoryEfficientAttention`: exact attention whose memory grows linearly with the
sequence length, in TensorFlow ops only."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from kvram import _checks
from kvram._order import after, in_xla
from kvram.layers import _cudnn_attention

__all__ = ["MemoryEfficientAttention", "chunked_attention"]

_NEG = -1e9  # what a masked score becomes (finite: a fully masked row stays finite)


@keras.saving.register_keras_serializable(package="kvram")
class MemoryEfficientAttention(keras.layers.MultiHeadAttention):
    """A drop-in `keras.layers.MultiHeadAttention` that never holds the n x n scores.

    Same constructor arguments, weights (so `set_weights(mha.get_weights())`
    works) and call signature (`query, value, key`, `attention_mask`, masks
    carried by the inputs, `use_causal_mask`). Keys and values are processed in
    chunks of `chunk_size` with a running maximum and running sum (online
    softmax), so the forward pass holds scores for one chunk of keys at a time;
    the backward pass recomputes each chunk's scores from the saved running
    maximum and sum
    instead of keeping them. Softmax statistics are float32 under mixed precision.

    `dropout` drops attention probabilities as `MultiHeadAttention` does; the
    drop mask of each chunk is regenerated from a seed in the backward pass, not
    stored (its random numbers differ from `MultiHeadAttention`'s).
    `return_attention_scores=True` is not supported (there are no full scores).

    In a step XLA compiles for a GPU (Keras's `jit_compile`, kvram's default
    there), under mixed precision, the attention is cuDNN's fused (flash)
    attention instead, where cuDNN takes it: a head size that is a multiple of
    8 up to 128, static shapes (batches of one size: a `tf.data` batch with
    `drop_remainder=True`), a causal mask over equal lengths, an attention mask
    of any shape Keras takes (as an additive bias; then even lengths while
    training), no attention dropout while training (see
    `_cudnn_attention.NO_DROPOUT`). It too keeps no n x n scores. Where cuDNN cannot take a case,
    "auto" uses the chunks and "cudnn" raises a `ValueError` saying why.
    ViT-B/16, batch 256, one H200: see the Benchmarks page (`kvram_fast`).

    Args:
        num_heads: as `keras.layers.MultiHeadAttention`.
        key_dim: as `keras.layers.MultiHeadAttention`.
        chunk_size: int >= 1, keys per chunk.
        implementation: "auto" (cuDNN's attention where it can run, as above;
            the chunks elsewhere), "chunked" (always the chunks) or "cudnn"
            (cuDNN's, or a `ValueError` saying why it cannot run).
        **kwargs: the other arguments of `keras.layers.MultiHeadAttention`.
    """

    IMPLEMENTATIONS = ("auto", "chunked", "cudnn")

    def __init__(self, num_heads, key_dim, chunk_size: int = 512, implementation: str = "auto", **kwargs):
        super().__init__(num_heads, key_dim, **kwargs)
        self.chunk_size, self.implementation = check_arguments(chunk_size, implementation)

    def get_config(self):
        config = super().get_config()
        config["chunk_size"] = self.chunk_size
        config["implementation"] = self.implementation
        return config

    def _compute_attention_mask(self, query, value, *args, use_causal_mask=False, **kwargs):
        # Keras would build the full (T, S) causal mask here; the causal part is
        # applied chunk by chunk instead (see `attend`).
        self._kvram_causal = bool(use_causal_mask)
        return super()._compute_attention_mask(query, value, *args, use_causal_mask=False, **kwargs)

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
        return attend(self, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask,
                      chunk_size=self.chunk_size, implementation=self.implementation)


def make_efficient(layer, chunk_size: int = 512, implementation: str = "auto") -> None:
    """Makes one `keras.layers.MultiHeadAttention` (or an instance of a subclass
    that computes its attention through `_compute_attention`, as KerasHub's
    `CachedMultiHeadAttention` does) compute it as `MemoryEfficientAttention`
    does, in place: the instance's `_compute_attention` and
    `_compute_attention_mask` are replaced, its class, weights and configuration
    are kept (so a saved model records the layer as it was)."""
    chunk_size, implementation = check_arguments(chunk_size, implementation)
    own_mask = type(layer)._compute_attention_mask

    def compute_attention_mask(query, value, *args, use_causal_mask=False, **kwargs):
        layer._kvram_causal = bool(use_causal_mask)  # applied chunk by chunk, as above
        return own_mask(layer, query, value, *args, use_causal_mask=False, **kwargs)

    def compute_attention(query, key, value, attention_mask=None, training=None,
                          return_attention_scores=False, use_causal_mask=False):
        return attend(layer, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask,
                      chunk_size=chunk_size, implementation=implementation)

    layer._compute_attention_mask = compute_attention_mask
    layer._compute_attention = compute_attention
    layer._kvram_efficient = (chunk_size, implementation)


def check_arguments(chunk_size, implementation) -> tuple:
    """(chunk_size, implementation) if both are allowed, else TypeError/ValueError."""
    chunk_size = _checks.positive_int("chunk_size", chunk_size)
    _check_implementation(implementation)
    return chunk_size, implementation


def _check_implementation(implementation):
    if implementation not in MemoryEfficientAttention.IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {MemoryEfficientAttention.IMPLEMENTATIONS}. Received: {implementation!r}"
        )


def attend(layer, query, key, value, attention_mask, training, return_attention_scores, use_causal_mask,
           chunk_size, implementation):
    """`MultiHeadAttention._compute_attention` of `layer` (its dropout rate,
    dropout seed generator and scale), by cuDNN or in chunks of keys."""
    if return_attention_scores:
        raise ValueError(
            "MemoryEfficientAttention never forms the full attention scores, so it "
            "cannot return them. Use keras.layers.MultiHeadAttention for that."
        )
    if len(query.shape) != 4:
        raise ValueError("MemoryEfficientAttention attends over one sequence axis.")
    # (B, T, N, H) -> (B, N, T, H)
    q = tf.transpose(query, [0, 2, 1, 3])
    k = tf.transpose(key, [0, 2, 1, 3])
    v = tf.transpose(value, [0, 2, 1, 3])
    causal = bool(use_causal_mask) or getattr(layer, "_kvram_causal", False) or _take_causal(layer)
    layer._kvram_causal = False
    dropout = layer._dropout if training else 0.0
    return _attend_heads(layer, q, k, v, attention_mask, causal, dropout, float(layer._inverse_sqrt_key_dim),
                         chunk_size, implementation, lambda: layer._dropout_layer.seed_generator)


def _attend_heads(layer, q, k, v, attention_mask, causal, dropout, scale, chunk_size, implementation, seeds):
    """(B, T, N, H) attention of (B, N, T, H) q and (B, Nk, S, H) k, v: cuDNN's
    where it takes the case, else the chunks (keys and values repeated to the
    queries' heads); `seeds()` is the seed generator of the chunks' dropout."""
    why_not = _why_not_cudnn(implementation, q, k, v, attention_mask, causal, bool(dropout))
    if why_not is None:
        bias = None
        if attention_mask is not None:
            bias = _cudnn_attention.bias_from_mask(_as_score_mask(attention_mask), q.dtype, q.shape[2], k.shape[2])
        out = _cudnn_attention.cudnn_attention(q, k, v, scale, causal=causal, bias=bias)  # no dropout here
        return tf.transpose(out, [0, 2, 1, 3]), None
    if implementation == "cudnn" and not _symbolic():
        raise ValueError(f"MemoryEfficientAttention(implementation='cudnn') cannot run here: {why_not}.")
    if k.shape[1] is not None and q.shape[1] is not None and k.shape[1] != q.shape[1]:
        k = tf.repeat(k, q.shape[1] // k.shape[1], axis=1)
        v = tf.repeat(v, q.shape[1] // v.shape[1], axis=1)
    q = q * tf.cast(scale, q.dtype)
    mask = None if attention_mask is None else _as_score_mask(attention_mask)
    seed = None
    if dropout:
        # The layer's own dropout layer's seed generator, so a Checkpoint that
        # restores the layer's state replays the same mask.
        from keras.src.backend.tensorflow.random import _cast_seed
        from keras.src.random.seed_generator import draw_seed

        seed = _cast_seed(draw_seed(seeds()))
    out = chunked_attention(q, k, v, mask, causal=causal, chunk_size=chunk_size, dropout=dropout, seed=seed)
    return tf.transpose(out, [0, 2, 1, 3]), None


def _as_score_mask(attention_mask):
    """An attention mask of any shape `MultiHeadAttention` takes, as a boolean mask
    that broadcasts against the (B, N, T, S) scores: Keras inserts axes before its
    last two until it has the scores' rank (`_masked_softmax`: (T, S) and (B, T, S)
    gain heads, (B, 1, 1, S) is used as it is)."""
    mask = tf.cast(attention_mask, tf.bool)
    if mask.shape.rank is None or mask.shape.rank > 4:
        raise ValueError(
            "MemoryEfficientAttention takes an attention_mask that broadcasts against the "
            f"(batch, heads, queries, keys) scores, of rank 2 to 4. Received: shape {mask.shape}"
        )
    while mask.shape.rank < 4:
        mask = tf.expand_dims(mask, -3)
    return mask


def _why_not_cudnn(implementation, q, k, v, attention_mask, causal, dropout):
    """None where this call runs cuDNN's attention, else why not."""
    if implementation == "chunked":
        return "implementation='chunked'"
    if causal and q.shape[2] != k.shape[2]:
        return f"a causal mask needs as many queries as keys (got {q.shape[2]} and {k.shape[2]})"
    if attention_mask is not None:
        rank = attention_mask.shape.rank
        if rank is None or not 2 <= rank <= 4:
            return f"its attention mask must be of rank 2 to 4 (got shape {attention_mask.shape})"
    if dropout:
        return _cudnn_attention.NO_DROPOUT
    reason = _cudnn_attention.supported(q, k, v, bias=attention_mask is not None, training=True)  # the gradient may be asked for
    if reason is None and not _cudnn_attention.in_xla_on_gpu(q):
        reason = "it runs only inside a step XLA compiles for a GPU (compile with jit_compile=True on a GPU)"
    return reason


def _take_causal(layer) -> bool:
    """Whether the layer's decoder block said, just before this call, that the
    mask it passed leaves out the causal part (`split_causal_mask`)."""
    causal = getattr(layer, "_kvram_split_causal", False)
    layer._kvram_split_causal = False
    return causal


def split_causal_mask(decoder, attention_layer) -> None:
    """Makes a KerasHub decoder block (GPT-2's `TransformerDecoder`, Llama's
    `LlamaTransformerDecoder`) hand its self-attention layer the padding (and
    any explicit) mask alone, and tell the layer that the attention is causal,
    in place, when it decodes without a cache (training). The layer then asks
    cuDNN for its causal kernel, which skips the masked half of the scores,
    instead of masking a merged (T, S) mask. A query row with no allowed key (a
    padded position whose earlier keys are all padding) spreads evenly over
    its earlier keys rather than over all keys: only padded positions, which
    carry no loss, see it."""
    from keras_hub.src.layers.modeling.transformer_layer_utils import merge_padding_and_attention_mask

    own = type(decoder)._compute_self_attention_mask

    def compute_self_attention_mask(**kwargs):
        if kwargs.get("self_attention_cache") is None and kwargs.get("use_causal_mask", True):
            attention_layer._kvram_split_causal = True
            return merge_padding_and_attention_mask(
                kwargs["decoder_sequence"], kwargs["decoder_padding_mask"], kwargs["decoder_attention_mask"])
        return own(decoder, **kwargs)

    decoder._compute_self_attention_mask = compute_self_attention_mask


def make_efficient_grouped(layer, chunk_size: int = 512, implementation: str = "auto") -> None:
    """Makes a KerasHub Llama attention layer (`LlamaAttention`: rotary
    embeddings applied, keys and values repeated to the queries' heads) compute
    its attention as `MemoryEfficientAttention` does, in place, with cuDNN's
    grouped-query attention where it runs: the repeated keys and values are
    taken back to their own heads (a strided slice XLA folds into the repeat)."""
    chunk_size, implementation = check_arguments(chunk_size, implementation)
    groups = int(layer.num_key_value_groups)

    def compute_attention(query, key, value, attention_mask=None, **kwargs):
        q = tf.transpose(query, [0, 2, 1, 3])
        k = tf.transpose(key[:, :, ::groups], [0, 2, 1, 3])
        v = tf.transpose(value[:, :, ::groups], [0, 2, 1, 3])
        causal = _take_causal(layer)
        return _attend_heads(layer, q, k, v, attention_mask, causal, 0.0, float(layer._inv_norm_factor),
                             chunk_size, implementation, None)[0]

    layer._compute_attention = compute_attention
    layer._kvram_efficient = (chunk_size, implementation)


def _symbolic() -> bool:
    """Keras is building a model (shapes only), not tracing a step."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def chunked_attention(q, k, v, mask=None, causal=False, chunk_size=512, dropout=0.0, seed=None):
    """softmax(q k^T + mask) v over chunks of keys, with a memory-light gradient.

    Args:
        q: (B, N, T, H), already scaled. k: (B, N, S, H). v: (B, N, S, Hv).
        mask: None or bool (B, T, S), or of rank 4 broadcasting against the
            (B, N, T, S) scores, True where attention is allowed.
        causal: also mask keys after each query (position s > t).
        chunk_size: keys per chunk. The keys are padded (masked) to a multiple
            of it, so every chunk has one static shape (XLA compiles the loop).
        dropout: rate at which attention probabilities are dropped (kept ones
            are scaled by 1 / (1 - rate)), as `MultiHeadAttention` does.
        seed: int32 tensor of shape (2,), needed when `dropout > 0`. The drop
            mask of chunk j is drawn from `stateless_fold_in(seed, j)`, so the
            backward pass regenerates it instead of storing it.
    """
    out_dtype = v.dtype
    if dropout and seed is None:
        raise ValueError("chunked_attention with dropout > 0 needs a `seed`.")
    if dropout:
        # the forward's drop masks drawn when its inputs are there: from the
        # seed alone XLA may draw every layer's masks at the step's start
        seed = _seed_after(seed, after(k))
    plan = _Plan(k, mask, causal, chunk_size, dropout, seed)

    @tf.custom_gradient
    def attend(q, k, v):
        out, m, l = _forward(q, k, v, plan)
        # The backward pass reads the output in the layer's dtype, as
        # FlashAttention does: under mixed precision a float32 copy kept for it
        # would be twice the size of the output the next layer keeps anyway.
        out = tf.cast(out, out_dtype)

        def grad(d_out):
            return _backward(q, k, v, out, m, l, d_out, plan)

        return out, grad

    return attend(q, k, v)


class _Plan:
    """The chunking of the keys, shared by the forward and backward passes."""

    def __init__(self, k, mask, causal, chunk_size, dropout, seed):
        if k.shape[2] is not None:
            # Fewer keys than a chunk: one chunk of exactly that many keys, not
            # a padded one (a 197-token ViT would otherwise score 512 keys).
            chunk_size = min(chunk_size, k.shape[2])
        self.size = chunk_size
        self.keys = tf.shape(k)[2]
        self.count = (self.keys + chunk_size - 1) // chunk_size
        self.padding = self.count * chunk_size - self.keys
        self.causal = causal
        self.dropout = float(dropout)
        self.seed = seed
        self.mask = None
        if mask is not None:
            if mask.shape.rank == 3:  # (B, T, S): the same for every head
                mask = mask[:, None]
            # (B', N', T', S) (each of B', N', T' the scores' size or 1) -> (C, B', N', T', chunk),
            # padded keys not allowed.
            shape = tf.shape(mask)
            mask = tf.broadcast_to(mask, tf.concat([shape[:3], [self.keys]], 0))
            mask = tf.pad(mask, [[0, 0], [0, 0], [0, 0], [0, self.padding]], constant_values=False)
            shape = tf.shape(mask)
            mask = tf.reshape(mask, [shape[0], shape[1], shape[2], self.count, chunk_size])
            self.mask = tf.transpose(mask, [3, 0, 1, 2, 4])

    def split(self, x):
        """(B, N, S, H) -> (C, B, N, chunk, H), zero-padded."""
        x = tf.pad(x, [[0, 0], [0, 0], [0, self.padding], [0, 0]])
        shape = tf.shape(x)
        x = tf.reshape(x, [shape[0], shape[1], self.count, self.size, shape[3]])
        return tf.transpose(x, [2, 0, 1, 3, 4])

    def join(self, chunks):
        """(C, B, N, chunk, H) -> (B, N, S, H), padding removed."""
        shape = tf.shape(chunks)
        x = tf.transpose(chunks, [1, 2, 0, 3, 4])
        x = tf.reshape(x, [shape[1], shape[2], shape[0] * shape[3], shape[4]])
        return x[:, :, : self.keys]

    def scores(self, q, k_chunk, j, rounded=False):
        """float32 scores of all queries against chunk j of the keys, and where
        the masks allow attention (None: everywhere). `rounded`: the product
        rounded as `_product` says (the backward pass's recomputed scores).

        As in Keras's `dot_product_attention`: masked scores are -1e9 (a row
        with no allowed key spreads evenly over the keys) and pass no gradient.
        The padding keys of the last chunk are -inf: they weigh nothing.
        """
        s = _product(q, k_chunk, q.dtype, adj_b=True, rounded=rounded)
        position = j * self.size + tf.range(self.size)
        allowed = None
        if self.mask is not None:
            allowed = tf.gather(self.mask, j)
        if self.causal:
            t = tf.range(tf.shape(q)[2])[:, None]
            c = (t >= position[None, :])[None, None]
            allowed = c if allowed is None else tf.logical_and(allowed, c)
        if allowed is not None:
            s = tf.where(allowed, s, tf.constant(_NEG, tf.float32))
            allowed = tf.cast(allowed, tf.float32)
        return tf.where((position < self.keys)[None, None, None, :], s, -math.inf), allowed

    def keep(self, shape, j, seed=None):
        """Dropout's scale for chunk j: 0 where dropped, 1 / (1 - rate) where
        kept, from `seed` (the plan's by default)."""
        seed = tf.random.experimental.stateless_fold_in(self.seed if seed is None else seed, j)
        kept = tf.random.stateless_uniform(shape, seed=seed) >= self.dropout
        return tf.cast(kept, tf.float32) / (1.0 - self.dropout)


def _seed_after(seed, zero):
    """`seed` plus `zero` (a float32 zero of `_order.after`) bit-cast to an
    integer: the same seed, which XLA can compute only once `zero` is there."""
    return seed + tf.cast(tf.bitcast(zero, tf.int32), seed.dtype)


def _product(a, b, dtype, adj_a=False, adj_b=False, rounded=False):
    """float32 `a @ b` of (..., m, k) by (..., k, n) tensors (`adj_a`, `adj_b`:
    transposed). Inside an XLA-compiled function, from inputs in `dtype` (the
    layer's own: bfloat16 or float16 under mixed precision) with a float32
    result, so that the products run on the tensor cores at that precision and
    are not rounded to it (TensorFlow's BatchMatMulV3 with Tout, which only XLA
    compiles for these types); elsewhere from float32 copies.

    `rounded`: there, the result is rounded to `dtype` (and read back as
    float32), as `MultiHeadAttention` rounds its own. The backward pass rounds
    its two (T, S)-shaped products (the recomputed scores and the
    probabilities' gradient), the largest tensors of its step: on a GPT-2-medium-shaped
    decoder (bf16, 8 x 1024 tokens, one H200) the step went from 139.4 to
    129.6 ms, and the bf16 gradient error stayed within 1% of
    MultiHeadAttention's. The forward's scores are not: rounded, the output
    error with a padding mask rose from 6.6e-3 to 8.1e-3, MultiHeadAttention's
    being 5.3e-3 (benchmarks/results/decoder_rounded_h200.json)."""
    if dtype != tf.float32 and in_xla(a):
        result = tf.raw_ops.BatchMatMulV3(x=tf.cast(a, dtype), y=tf.cast(b, dtype),
                                          Tout=dtype if rounded else tf.float32, adj_x=adj_a, adj_y=adj_b)
        return tf.cast(result, tf.float32)
    return tf.linalg.matmul(tf.cast(a, tf.float32), tf.cast(b, tf.float32), adjoint_a=adj_a, adjoint_b=adj_b)


def _forward(q, k, v, plan):
    shape = tf.shape(q)
    b, n, t = shape[0], shape[1], shape[2]
    hv = tf.shape(v)[3]
    k_chunks, v_chunks = plan.split(k), plan.split(v)
    m0 = tf.fill([b, n, t, 1], tf.constant(-math.inf, tf.float32))
    l0 = tf.zeros([b, n, t, 1], tf.float32)
    o0 = tf.zeros(tf.stack([b, n, t, hv]), tf.float32)

    def body(j, m, l, o):
        s, _ = plan.scores(q, tf.gather(k_chunks, j), j)
        m_new = tf.maximum(m, tf.reduce_max(s, axis=-1, keepdims=True))
        p = tf.exp(s - m_new)
        correction = tf.exp(m - m_new)
        l = l * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
        if plan.dropout:
            p = p * plan.keep(tf.shape(p), j)
        o = o * correction + _product(p, tf.gather(v_chunks, j), v.dtype)
        return j + 1, m_new, l, o

    _, m, l, o = tf.while_loop(
        lambda j, *_: j < plan.count,
        body,
        (tf.constant(0), m0, l0, o0),
        parallel_iterations=1,
    )
    # m and l are kept apart: in a fully masked row m is -1e9, and m + log(l)
    # would round log(l) away in float32.
    return o / l, m, l


def _backward(q, k, v, out, m, l, d_out, plan):
    dependency = after(d_out)  # recomputed when this layer's gradient arrives
    q = q + tf.cast(dependency, q.dtype)
    k = k + tf.cast(dependency, k.dtype)
    v = v + tf.cast(dependency, v.dtype)
    # the drop masks too: with one chunk XLA unrolls both loops, and would
    # otherwise merge the backward's mask into the forward's and keep it
    # from one pass to the other (a (B, N, T, S) mask a layer)
    seed = _seed_after(plan.seed, dependency) if plan.dropout else None
    d_out = tf.cast(d_out, tf.float32)
    delta = tf.reduce_sum(d_out * tf.cast(out, tf.float32), axis=-1, keepdims=True)  # (B, N, T, 1)
    d_out = tf.cast(d_out, v.dtype)
    k_chunks, v_chunks = plan.split(k), plan.split(v)
    dk_parts = tf.TensorArray(tf.float32, size=plan.count)
    dv_parts = tf.TensorArray(tf.float32, size=plan.count)

    def body(j, dq, dk_parts, dv_parts):
        k_c, v_c = tf.gather(k_chunks, j), tf.gather(v_chunks, j)
        s, allowed = plan.scores(q, k_c, j, rounded=True)
        p = tf.exp(s - m) / l  # recomputed probabilities of this chunk
        dp = _product(d_out, v_c, v.dtype, adj_b=True, rounded=True)
        if plan.dropout:
            keep = plan.keep(tf.shape(p), j, seed)
            dv_parts = dv_parts.write(j, _product(p * keep, d_out, v.dtype, adj_a=True))
            dp = dp * keep
        else:
            dv_parts = dv_parts.write(j, _product(p, d_out, v.dtype, adj_a=True))
        ds = p * (dp - delta)
        if allowed is not None:
            ds = ds * allowed  # masked scores pass no gradient
        dq = dq + _product(ds, k_c, k.dtype)
        dk_parts = dk_parts.write(j, _product(ds, q, q.dtype, adj_a=True))
        return j + 1, dq, dk_parts, dv_parts

    _, dq, dk_parts, dv_parts = tf.while_loop(
        lambda j, *_: j < plan.count,
        body,
        (tf.constant(0), tf.zeros(tf.shape(q), tf.float32), dk_parts, dv_parts),
        parallel_iterations=1,
    )
    dk = plan.join(dk_parts.stack())
    dv = plan.join(dv_parts.stack())
    return tf.cast(dq, q.dtype), tf.cast(dk, k.dtype), tf.cast(dv, v.dtype)
