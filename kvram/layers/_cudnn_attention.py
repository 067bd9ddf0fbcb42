"""cuDNN's fused (flash) attention in an XLA-compiled TensorFlow step on a GPU.

TensorFlow has no op for it, and XLA's own rewrite of softmax(QK^T)V into it
(`--xla_gpu_enable_cudnn_fmha`) needs an even sequence length when training and
JAX's shape of the softmax gradient: on ViT-B/16 (197 tokens) under TensorFlow
it rewrites nothing. So the step asks for the kernels by name, as XLA's
rewriter would leave them and as JAX's cuDNN attention does: XLA custom calls
`__cudnn$fmha[ScaleBias]Softmax[Dropout][Backward]`, made through TensorFlow's
`XlaCustomCallV2` op, which hands its `backend_config` to XLA unchanged. XLA
builds the cuDNN graph and sizes its workspace when it compiles the step.

Operands and results are those of JAX's `fused_attention_stablehlo.py`:
forward (q, k, v[, bias]) -> (out, float32 softmax statistics, workspace);
backward (q, k, v, statistics, d_out[, bias], out) -> (dq, dk, dv, workspace).
Grouped-query attention is cuDNN's own: k and v may have fewer heads than q.

Dropout: the calls with dropout (`...SoftmaxDropout`, rate and seed in the
configuration) are traced as XLA expects them, but a step that runs one ends
the process with a segmentation fault under TensorFlow 2.21 on an H200 (every
case with dropout, with or without a causal mask or a bias; the same cases
without dropout run), with the GPU machine's cuDNN 9.14 and with PyTorch's
cuDNN 9.19 loaded instead (benchmarks/results/attention_dropout_cudnn_h200.json).
It crashes alike with JAX's whole configuration (`is_flash_attention`,
`sliding_window_length`, the operation queue fields) and with XLA's command
buffers off (`--xla_gpu_enable_command_buffer=`), where JAX 0.11's own calls
with dropout run on the same GPU. The cause in the sources (not confirmed by a
debugger): since openxla/xla#16849 XLA's cuDNN thunk keeps one dropout offset
per local device, in a vector sized by `ExecutableRunOptions.local_device_count`
and read at the device's ordinal; TensorFlow's `XlaLaunch` (`RunExecutable` in
`tensorflow/compiler/jit/xla_launch_util.cc`) never sets that count, which
stays 0 ("unset"), where PjRt, JAX's runtime, sets it. TensorFlow's own PjRt
launch path (TF_XLA_FLAGS `--tf_xla_use_device_api=true
--tf_xla_enable_device_api_for_gpu=true`) crashes on an H200 on any
XLA-compiled step, a single matmul included, so it is no way round
(benchmarks/results/attention_dropout_pjrt_h200.json). So `cudnn_attention`
refuses a rate above 0 and `MemoryEfficientAttention` computes attention
dropout in its chunks.
"""

from __future__ import annotations

import json

import tensorflow as tf

from kvram._order import in_xla

# Tensor-core engine 0 with the knobs XLA's rewriter sets (cudnn_fused_mha_rewriter.cc).
_ALGORITHM = {"algo_id": "0", "math_type": "TENSOR_OP_MATH", "tuning_knobs": {"17": "1", "24": "0"},
              "is_cudnn_frontend": True, "workspace_size": "0"}
NO_DROPOUT = ("cuDNN's attention with dropout crashes TensorFlow 2.21's XLA runtime (a segmentation fault on an "
              "H200 with cuDNN 9.14 and 9.19), so attention dropout while training runs in the chunks")
_DTYPES = {tf.bfloat16: "BF16", tf.float16: "F16"}


def supported(q, k, v, bias=False, training=False) -> str | None:
    """Why cuDNN's attention cannot take (B, N, T, H) q and (B, Nk, S, H) k, v
    (N a multiple of Nk), with a bias or not, training or not; None when it can."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"its inputs must be float16 or bfloat16 alike (got {q.dtype.name}, {k.dtype.name}, {v.dtype.name})"
    shapes = [q.shape, k.shape, v.shape]
    if any(s.rank != 4 or None in s.as_list() for s in shapes):
        return f"it needs static (batch, heads, length, head_dim) shapes (got {[s.as_list() for s in shapes]})"
    h = q.shape[3]
    if k.shape[3] != h or v.shape[3] != h or h > 128 or h % 8:
        return f"its head size must be the same for queries, keys and values, a multiple of 8 up to 128 (got {h})"
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or q.shape[1] % k.shape[1]:
        return (f"keys and values need the queries' batch, one shape, and a number of heads that divides the "
                f"queries' (got {q.shape.as_list()}, {k.shape.as_list()}, {v.shape.as_list()})")
    if bias and training and (q.shape[2] % 2 or k.shape[2] % 2):
        return f"with a mask while training it needs even lengths (got {q.shape[2]} queries, {k.shape[2]} keys)"
    return None


def call_target(bias: bool, dropout: bool, backward: bool) -> str:
    """The custom call's name, as XLA's cuDNN fMHA runtime knows it."""
    return ("__cudnn$fmha" + ("ScaleBias" if bias else "") + "Softmax" + ("Dropout" if dropout else "")
            + ("Backward" if backward else ""))


def in_xla_on_gpu(x) -> bool:
    """Whether `x` is being traced into an XLA-compiled function bound for a GPU."""
    return in_xla(x) and bool(tf.config.list_logical_devices("GPU")) and "CPU" not in (x.device or "").upper()


def _dims(lhs_contracting, rhs_contracting):
    return {"lhs_contracting_dimensions": [str(lhs_contracting)], "rhs_contracting_dimensions": [str(rhs_contracting)],
            "lhs_batch_dimensions": ["0", "1"], "rhs_batch_dimensions": ["0", "1"]}


def backend_config(b, n, t, s, dtype, scale, causal, backward, dropout=0.0, seed=42) -> str:
    """The GpuBackendConfig (JSON) of the forward or backward call, every
    tensor (batch, heads, length, head_dim) in row-major order."""
    fmha = {
        "algorithm": _ALGORITHM,
        "fmha_scale": float(scale),
        "dropout_rate": float(dropout),
        "seed": int(seed),
        "intermediate_tensor_shape": {"element_type": _DTYPES[dtype], "dimensions": [str(d) for d in (b, n, t, s)],
                                      "layout": {"minor_to_major": ["3", "2", "1", "0"]}},
        "mask_type": "CAUSAL" if causal else "NO_MASK",
    }
    if backward:
        fmha.update(  # dK = dP^T Q, dQ = dP K, dV = P^T dO, dP = dO V^T
            bmm1_grad_gemm1_dot_dimension_numbers=_dims(2, 2),
            bmm1_grad_gemm2_dot_dimension_numbers=_dims(3, 2),
            bmm2_grad_gemm1_dot_dimension_numbers=_dims(2, 2),
            bmm2_grad_gemm2_dot_dimension_numbers=_dims(3, 3),
        )
    else:
        fmha.update(bmm1_dot_dimension_numbers=_dims(3, 3), bmm2_dot_dimension_numbers=_dims(3, 2))  # QK^T, PV
    return json.dumps({"cudnn_fmha_backend_config": fmha})


def bias_from_mask(mask, dtype, q_len, k_len):
    """A boolean attention mask (True: attend) that broadcasts against the
    (B, N, T, S) scores, as the additive bias cuDNN takes: 0 where allowed, a
    large negative number elsewhere (a row with no allowed key spreads evenly,
    as Keras's own masking does), of shape (B or 1, N or 1, T, S)."""
    mask = tf.cast(mask, tf.bool)
    while mask.shape.rank < 4:
        mask = tf.expand_dims(mask, -3)
    shape = mask.shape.as_list()
    mask = tf.broadcast_to(mask, shape[:2] + [q_len, k_len])
    negative = -0.7 * float(tf.as_dtype(dtype).max)  # finite: adding a score cannot overflow it
    return tf.stop_gradient(tf.where(mask, tf.zeros([], dtype), tf.constant(negative, dtype)))


def cudnn_attention(q, k, v, scale: float, causal: bool = False, bias=None, dropout: float = 0.0, seed: int = 42,
                    allow_dropout: bool = False):
    """softmax(scale q k^T + bias [causal]) v by cuDNN, for (B, N, T, H) q and
    (B, Nk, S, H) k, v (N a multiple of Nk: grouped-query attention) of one
    float16/bfloat16 dtype, traced inside an XLA-compiled function that runs on
    a GPU (elsewhere XLA cannot compile it).

    `bias`: None or (B or 1, N or 1, T, S) in q's dtype (`bias_from_mask`); it
    gets no gradient. `dropout`: the rate at which probabilities are dropped
    (kept ones scaled by 1 / (1 - rate)), by cuDNN with the integer `seed`;
    refused (a ValueError) unless `allow_dropout`, which only traces the calls
    (see the module's docstring: running them crashes). The backward pass is cuDNN's too: it keeps the
    output and the float32 softmax statistics (B, N, T), never the (T, S)
    probabilities."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    reason = supported(q, k, v, bias is not None, training=True)
    if reason:
        raise ValueError(f"cuDNN attention cannot run here: {reason}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1). Received: {dropout}")
    if dropout and not allow_dropout:
        raise ValueError(f"cuDNN attention cannot run here: {NO_DROPOUT}. Received: dropout={dropout}")
    b, n, t, h = q.shape
    nk, s = k.shape[1], k.shape[2]
    extra = []
    if bias is not None:
        bias = tf.cast(bias, q.dtype)
        if bias.shape.rank != 4 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, n) \
                or bias.shape[2:] != (t, s):
            raise ValueError(f"cuDNN attention takes a bias of shape (1 or {b}, 1 or {n}, {t}, {s}). "
                             f"Received: {bias.shape.as_list()}")
        extra = [bias]
    options = dict(dropout=dropout, seed=seed)
    forward = backend_config(b, n, t, s, q.dtype, scale, causal, backward=False, **options)
    backward = backend_config(b, n, t, s, q.dtype, scale, causal, backward=True, **options)
    targets = [call_target(bool(extra), dropout > 0, backward=side) for side in (False, True)]

    @tf.custom_gradient
    def attend(q, k, v):
        # results: the output, the softmax statistics and a workspace XLA sizes
        out, stats, _ = gen_xla_ops.xla_custom_call_v2(
            operands=[q, k, v] + extra, call_target_name=targets[0], backend_config=forward,
            has_side_effect=False, result_dtypes=[q.dtype, tf.float32, tf.uint8],
            result_shapes=[(b, n, t, h), (b, n, t), (0,)],
        )

        def grad(d_out):
            dq, dk, dv, _ = gen_xla_ops.xla_custom_call_v2(
                operands=[q, k, v, stats, tf.cast(d_out, q.dtype)] + extra + [out],
                call_target_name=targets[1], backend_config=backward,
                has_side_effect=False, result_dtypes=[q.dtype, q.dtype, q.dtype, tf.uint8],
                result_shapes=[(b, n, t, h), (b, nk, s, h), (b, nk, s, h), (0,)],
            )
            return dq, dk, dv

        return out, grad

    return attend(q, k, v)
