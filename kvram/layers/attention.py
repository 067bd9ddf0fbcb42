"""`MemoryEfficientAttention`: exact attention whose memory grows linearly with the
sequence length, in TensorFlow ops only."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from kvram import _checks

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
    the backward pass recomputes each chunk's scores from the saved log-sum-exp
    instead of keeping them. Softmax statistics are float32 under mixed precision.

    Not supported yet: `dropout > 0` in training (raises), and
    `return_attention_scores=True` (there are no full scores to return).

    Args:
        num_heads, key_dim, ...: as `keras.layers.MultiHeadAttention`.
        chunk_size: int >= 1, keys per chunk.
    """

    def __init__(self, num_heads, key_dim, chunk_size: int = 512, **kwargs):
        super().__init__(num_heads, key_dim, **kwargs)
        self.chunk_size = _checks.positive_int("chunk_size", chunk_size)

    def get_config(self):
        config = super().get_config()
        config["chunk_size"] = self.chunk_size
        return config

    def _compute_attention_mask(self, query, value, *args, use_causal_mask=False, **kwargs):
        # Keras would build the full (T, S) causal mask here; the causal part is
        # applied chunk by chunk instead (see `_compute_attention`).
        self._kvram_causal = bool(use_causal_mask)
        return super()._compute_attention_mask(query, value, *args, use_causal_mask=False, **kwargs)

    def _compute_attention(
        self,
        query,
        key,
        value,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
        use_causal_mask=False,
    ):
        if return_attention_scores:
            raise ValueError(
                "MemoryEfficientAttention never forms the full attention scores, so it "
                "cannot return them. Use keras.layers.MultiHeadAttention for that."
            )
        if self._dropout > 0.0 and training:
            raise NotImplementedError(
                "MemoryEfficientAttention does not apply attention dropout yet. "
                f"Received: dropout={self._dropout} in training"
            )
        if len(query.shape) != 4:
            raise ValueError("MemoryEfficientAttention attends over one sequence axis.")
        # (B, T, N, H) -> (B, N, T, H)
        q = tf.transpose(query, [0, 2, 1, 3]) * tf.cast(self._inverse_sqrt_key_dim, query.dtype)
        k = tf.transpose(key, [0, 2, 1, 3])
        v = tf.transpose(value, [0, 2, 1, 3])
        mask = None if attention_mask is None else tf.cast(attention_mask, tf.bool)
        causal = bool(use_causal_mask) or getattr(self, "_kvram_causal", False)
        self._kvram_causal = False
        out = chunked_attention(q, k, v, mask, causal=causal, chunk_size=self.chunk_size)
        return tf.transpose(out, [0, 2, 1, 3]), None


def chunked_attention(q, k, v, mask=None, causal=False, chunk_size=512):
    """softmax(q k^T + mask) v over chunks of keys, with a memory-light gradient.

    Args:
        q: (B, N, T, H), already scaled. k: (B, N, S, H). v: (B, N, S, Hv).
        mask: None or bool (B, T, S), True where attention is allowed.
        causal: also mask keys after each query (position s > t).
        chunk_size: keys per chunk.
    """
    out_dtype = v.dtype

    @tf.custom_gradient
    def attend(q, k, v):
        out, lse = _forward(q, k, v, mask, causal, chunk_size)

        def grad(d_out):
            return _backward(q, k, v, out, lse, d_out, mask, causal, chunk_size)

        return tf.cast(out, out_dtype), grad

    return attend(q, k, v)


def _scores(q, k_chunk, start, mask, causal):
    """float32 scores of all queries against one chunk of keys, masks applied."""
    s = tf.einsum("bnth,bnsh->bnts", tf.cast(q, tf.float32), tf.cast(k_chunk, tf.float32))
    size = tf.shape(k_chunk)[2]
    allowed = None
    if mask is not None:
        allowed = mask[:, None, :, start : start + size]
    if causal:
        t = tf.range(tf.shape(q)[2])[:, None]
        s_index = start + tf.range(size)[None, :]
        c = (t >= s_index)[None, None]
        allowed = c if allowed is None else tf.logical_and(allowed, c)
    if allowed is not None:
        s = tf.where(allowed, s, tf.constant(_NEG, tf.float32))
    return s


def _chunks(total, chunk_size):
    return (total + chunk_size - 1) // chunk_size


def _forward(q, k, v, mask, causal, chunk_size):
    shape = tf.shape(q)
    b, n, t = shape[0], shape[1], shape[2]
    hv = tf.shape(v)[3]
    s_len = tf.shape(k)[2]
    m0 = tf.fill([b, n, t, 1], tf.constant(-math.inf, tf.float32))
    l0 = tf.zeros([b, n, t, 1], tf.float32)
    o0 = tf.zeros(tf.stack([b, n, t, hv]), tf.float32)

    def body(j, m, l, o):
        start = j * chunk_size
        k_c = k[:, :, start : start + chunk_size]
        v_c = tf.cast(v[:, :, start : start + chunk_size], tf.float32)
        s = _scores(q, k_c, start, mask, causal)
        m_new = tf.maximum(m, tf.reduce_max(s, axis=-1, keepdims=True))
        p = tf.exp(s - m_new)
        correction = tf.exp(m - m_new)
        l = l * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
        o = o * correction + tf.einsum("bnts,bnsh->bnth", p, v_c)
        return j + 1, m_new, l, o

    _, m, l, o = tf.while_loop(
        lambda j, *_: j < _chunks(s_len, chunk_size),
        body,
        (tf.constant(0), m0, l0, o0),
        parallel_iterations=1,
    )
    return o / l, m + tf.math.log(l)


def _backward(q, k, v, out, lse, d_out, mask, causal, chunk_size):
    d_out = tf.cast(d_out, tf.float32)
    delta = tf.reduce_sum(d_out * out, axis=-1, keepdims=True)  # (B, N, T, 1)
    s_len = tf.shape(k)[2]
    q32 = tf.cast(q, tf.float32)
    count = _chunks(s_len, chunk_size)
    dk_parts = tf.TensorArray(tf.float32, size=count, infer_shape=False)
    dv_parts = tf.TensorArray(tf.float32, size=count, infer_shape=False)

    def body(j, dq, dk_parts, dv_parts):
        start = j * chunk_size
        k_c = tf.cast(k[:, :, start : start + chunk_size], tf.float32)
        v_c = tf.cast(v[:, :, start : start + chunk_size], tf.float32)
        s = _scores(q, k_c, start, mask, causal)
        p = tf.exp(s - lse)  # recomputed probabilities of this chunk
        dv_parts = dv_parts.write(j, tf.einsum("bnts,bnth->sbnh", p, d_out))
        dp = tf.einsum("bnth,bnsh->bnts", d_out, v_c)
        ds = p * (dp - delta)
        dq = dq + tf.einsum("bnts,bnsh->bnth", ds, k_c)
        dk_parts = dk_parts.write(j, tf.einsum("bnts,bnth->sbnh", ds, q32))
        return j + 1, dq, dk_parts, dv_parts

    _, dq, dk_parts, dv_parts = tf.while_loop(
        lambda j, *_: j < count,
        body,
        (tf.constant(0), tf.zeros_like(q32), dk_parts, dv_parts),
        parallel_iterations=1,
    )
    dk = _concat_chunks(dk_parts)
    dv = _concat_chunks(dv_parts)
    return tf.cast(dq, q.dtype), tf.cast(dk, k.dtype), tf.cast(dv, v.dtype)


def _concat_chunks(parts):
    """TensorArray of (c_j, B, N, H) chunks -> (B, N, S, H)."""
    return tf.transpose(parts.concat(), [1, 2, 0, 3])
