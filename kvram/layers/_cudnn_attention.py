"""cuDNN's fused (flash) attention in an XLA-compiled TensorFlow step on a GPU.

TensorFlow has no op for it, and XLA's own rewrite of softmax(QK^T)V into it
(`--xla_gpu_enable_cudnn_fmha`) needs an even sequence length when training and
JAX's shape of the softmax gradient: on ViT-B/16 (197 tokens) under TensorFlow
it rewrites nothing. So the step asks for the kernels by name, as XLA's
rewriter would leave them and as JAX's cuDNN attention does: XLA custom calls
`__cudnn$fmhaSoftmax` (`...Backward`), made through TensorFlow's
`XlaCustomCallV2` op, which hands its `backend_config` to XLA unchanged. XLA
builds the cuDNN graph and sizes its workspace when it compiles the step.
"""

from __future__ import annotations

import json

import tensorflow as tf

# Tensor-core engine 0 with the knobs XLA's rewriter sets (cudnn_fused_mha_rewriter.cc).
_ALGORITHM = {"algo_id": "0", "math_type": "TENSOR_OP_MATH", "tuning_knobs": {"17": "1", "24": "0"},
              "is_cudnn_frontend": True, "workspace_size": "0"}
_DTYPES = {tf.bfloat16: "BF16", tf.float16: "F16"}


def supported(q, k, v) -> str | None:
    """Why cuDNN's attention cannot take (B, N, T, H) q and (B, N, S, H) k, v;
    None when it can."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"its inputs must be float16 or bfloat16 alike (got {q.dtype.name}, {k.dtype.name}, {v.dtype.name})"
    shapes = [q.shape, k.shape, v.shape]
    if any(s.rank != 4 or None in s.as_list() for s in shapes):
        return f"it needs static (batch, heads, length, head_dim) shapes (got {[s.as_list() for s in shapes]})"
    h = q.shape[3]
    if k.shape[3] != h or v.shape[3] != h or h > 128 or h % 8:
        return f"its head size must be the same for queries, keys and values, a multiple of 8 up to 128 (got {h})"
    return None


def in_xla(x) -> bool:
    """Whether `x` is being traced into an XLA-compiled function."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    return not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def in_xla_on_gpu(x) -> bool:
    """Whether `x` is being traced into an XLA-compiled function bound for a GPU."""
    return in_xla(x) and bool(tf.config.list_logical_devices("GPU")) and "CPU" not in (x.device or "").upper()


def _dims(lhs_contracting, rhs_contracting):
    return {"lhs_contracting_dimensions": [str(lhs_contracting)], "rhs_contracting_dimensions": [str(rhs_contracting)],
            "lhs_batch_dimensions": ["0", "1"], "rhs_batch_dimensions": ["0", "1"]}


def backend_config(b, n, t, s, dtype, scale, causal, backward) -> str:
    """The GpuBackendConfig (JSON) of the forward or backward call, every
    tensor (batch, heads, length, head_dim) in row-major order."""
    fmha = {
        "algorithm": _ALGORITHM,
        "fmha_scale": float(scale),
        "dropout_rate": 0.0,
        "seed": 42,
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


def cudnn_attention(q, k, v, scale: float, causal: bool = False):
    """softmax(scale q k^T [causal]) v by cuDNN, for (B, N, T, H) q and
    (B, N, S, H) k, v of one float16/bfloat16 dtype, traced inside an
    XLA-compiled function that runs on a GPU (elsewhere XLA cannot compile it).
    The backward pass is cuDNN's too: it keeps the output and the float32
    softmax statistics (B, N, T), never the (T, S) probabilities."""
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    reason = supported(q, k, v)
    if reason:
        raise ValueError(f"cuDNN attention cannot run here: {reason}.")
    b, n, t, h = q.shape
    s = k.shape[2]
    forward = backend_config(b, n, t, s, q.dtype, scale, causal, backward=False)
    backward = backend_config(b, n, t, s, q.dtype, scale, causal, backward=True)

    @tf.custom_gradient
    def attend(q, k, v):
        # results: the output, the softmax statistics and a workspace XLA sizes
        out, stats, _ = gen_xla_ops.xla_custom_call_v2(
            operands=[q, k, v], call_target_name="__cudnn$fmhaSoftmax", backend_config=forward,
            has_side_effect=False, result_dtypes=[q.dtype, tf.float32, tf.uint8],
            result_shapes=[(b, n, t, h), (b, n, t), (0,)],
        )

        def grad(d_out):
            dq, dk, dv, _ = gen_xla_ops.xla_custom_call_v2(
                operands=[q, k, v, stats, tf.cast(d_out, q.dtype), out],
                call_target_name="__cudnn$fmhaSoftmaxBackward", backend_config=backward,
                has_side_effect=False, result_dtypes=[q.dtype, q.dtype, q.dtype, tf.uint8],
                result_shapes=[(b, n, t, h), (b, n, s, h), (b, n, s, h), (0,)],
            )
            return dq, dk, dv

        return out, grad

    return attend(q, k, v)
