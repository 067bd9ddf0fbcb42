"""Does XLA (as TensorFlow 2.21 ships it) run cuDNN's flash attention when a step
asks for it by name? A probe, on one GPU.

TF 2.21's XLA rewrites softmax(QK^T)V into cuDNN's fused attention only where
the training sequence length is even (`IsFlashAttention` in XLA's
cudnn_fused_mha_rewriter.cc: `s_q % 2 == 0 && s_kv % 2 == 0`) and the backward
graph has JAX's autodiff shape; ViT-B/16 has 197 tokens and TensorFlow's softmax
gradient has another shape, so the `--xla_gpu_enable_cudnn_fmha` flag rewrites
nothing there (benchmarks/README.md). Here the step calls the fused kernels
directly, as the rewriter's output would: XLA custom calls
`__cudnn$fmhaSoftmax` and `__cudnn$fmhaSoftmaxBackward` (TensorFlow's
`XlaCustomCallV2` op, which passes its `backend_config` string through), with
Q, K, V as (batch, heads, tokens, head_dim).

    python benchmarks/attention/cudnn_probe.py check          # outputs and gradients vs plain attention
    python benchmarks/attention/cudnn_probe.py time           # fwd+bwd of ViT-B's attention, batch 256
    python benchmarks/attention/cudnn_probe.py vit --out r.json   # ViT-B/16 batch 256 with it
                                                                  # (the bench's kvram_mha config)
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)


def cudnn_attention(q, k, v, scale):
    """kvram's cuDNN attention (kvram/layers/_cudnn_attention.py). The results of
    2026-11-26 were taken with this script's own copy of it, the same calls
    and backend configuration, before it moved into kvram."""
    from kvram.layers._cudnn_attention import cudnn_attention as attend

    return attend(q, k, v, scale)


def plain_attention(q, k, v, scale):
    import tensorflow as tf

    scores = tf.einsum("bnth,bnsh->bnts", tf.cast(q, "float32"), tf.cast(k, "float32")) * scale
    return tf.einsum("bnts,bnsh->bnth", tf.nn.softmax(scores, -1), tf.cast(v, "float32"))


def check():
    import numpy as np
    import tensorflow as tf

    results = {}
    for shape in ((2, 4, 197, 64), (2, 4, 256, 64), (4, 12, 197, 64)):
        rng = np.random.default_rng(0)
        q, k, v, d = (tf.constant(rng.standard_normal(shape), tf.bfloat16) for _ in range(4))
        scale = shape[-1] ** -0.5
        found = {}
        for name, fn in (("cudnn", cudnn_attention), ("plain", plain_attention)):
            @tf.function(jit_compile=True)
            def step(q, k, v, d):
                with tf.GradientTape() as tape:
                    tape.watch([q, k, v])
                    out = fn(q, k, v, scale)
                    loss = tf.reduce_sum(tf.cast(out, "float32") * tf.cast(d, "float32"))
                return [out] + tape.gradient(loss, [q, k, v])

            try:
                found[name] = [tf.cast(t, "float32").numpy() for t in step(q, k, v, d)]
            except Exception as error:  # noqa: BLE001 - reported
                found[name] = f"{type(error).__name__}: {str(error)[:1500]}"
        if isinstance(found["cudnn"], str):
            results[str(shape)] = {"error": found["cudnn"]}
        else:
            results[str(shape)] = {
                name: float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                for name, a, b in zip(("out", "dq", "dk", "dv"), found["cudnn"], found["plain"])
            }
        print(shape, results[str(shape)], flush=True)
    return results


def time_attention(batch=256, heads=12, tokens=197, head_dim=64, steps=50):
    import tensorflow as tf

    shape = (batch, heads, tokens, head_dim)
    q, k, v, d = (tf.random.normal(shape, dtype=tf.bfloat16) for _ in range(4))
    scale = head_dim ** -0.5
    results = {}
    for name, fn in (("cudnn", cudnn_attention), ("plain_bf16", None)):
        def attend(q, k, v, fn=fn):
            if fn is not None:
                return fn(q, k, v, scale)
            scores = tf.einsum("bnth,bnsh->bnts", q, k) * tf.cast(scale, q.dtype)
            return tf.einsum("bnts,bnsh->bnth", tf.nn.softmax(scores, -1), v)

        @tf.function(jit_compile=True)
        def step(q, k, v, d):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v])
                loss = tf.reduce_sum(tf.cast(attend(q, k, v), "float32") * tf.cast(d, "float32"))
            return tape.gradient(loss, [q, k, v])

        step(q, k, v, d)[0].numpy()
        tf.config.experimental.reset_memory_stats("GPU:0")
        start = time.perf_counter()
        for _ in range(steps):
            out = step(q, k, v, d)
        out[0].numpy()
        seconds = (time.perf_counter() - start) / steps
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        results[name] = {"ms_fwd_bwd": seconds * 1e3, "peak_gib": peak / 2**30}
        print(name, results[name], flush=True)
    return results


def vit(config="kvram_mha_nockpt_pin_spe16_cublaslt", batch=256, steps=32, warmup=16):
    """ViT-B/16 as `benchmarks/vit/bench.py` runs `config`, its attention
    (keras.layers.MultiHeadAttention) computed by `cudnn_attention`."""
    from benchmarks.common import add_xla_flags, timed_fit
    from benchmarks.vit.bench import CONFIGS, build_tf

    settings = dict(CONFIGS[config][1])
    assert settings["attention"] == "keras", config
    add_xla_flags(settings)
    import keras
    import tensorflow as tf

    def _compute_attention(self, query, key, value, attention_mask=None, training=None,
                           return_attention_scores=False, use_causal_mask=False):
        assert attention_mask is None and not return_attention_scores and not self._dropout
        q, k, v = (tf.transpose(t, [0, 2, 1, 3]) for t in (query, key, value))
        out = cudnn_attention(q, k, v, float(self._inverse_sqrt_key_dim))
        return tf.transpose(out, [0, 2, 1, 3]), None

    keras.layers.MultiHeadAttention._compute_attention = _compute_attention
    model, data = build_tf(settings, batch, "GPU:0")
    timed = timed_fit(model, data, steps, warmup, ["GPU:0"])
    result = {
        "config": config + " with cudnn_attention",
        "img_per_s": batch * timed["steps"] / timed["seconds"],
        "peak_gib": timed["peak_gib"]["GPU:0"],
        "final_loss": timed["loss"],
        "timed_steps": timed["steps"],
        "tensorflow": tf.__version__,
    }
    print(result, flush=True)
    return result


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("check", "time", "vit"))
    parser.add_argument("--config", default="kvram_mha_nockpt_pin_spe16_cublaslt")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"check": check, "time": time_attention}.get(args.what, lambda: vit(args.config))()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"probe": args.what, "command": "python " + " ".join(sys.argv), "result": result}, f, indent=2)


if __name__ == "__main__":
    main()
