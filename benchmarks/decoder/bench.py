"""A GPT-2-medium-shaped decoder on one GPU: plain Keras vs kvram, in one run.

KerasHub's `GPT2Backbone` built from a config (nothing downloaded: 24 layers,
hidden 1024, 16 heads, MLP 4096, vocabulary 50257, sequence 1024) with a Dense
LM head, mixed_bfloat16, AdamW (lr 1e-4), XLA, on one synthetic batch of token
ids (held by `tf.data` on the host, copied every step). Each configuration runs
in its own process and reports tokens/s over timed steps after warm-up and
TensorFlow's peak GPU memory during them (weights, gradients and optimizer
state included).

    python benchmarks/decoder/bench.py --out results.json
    python benchmarks/decoder/bench.py --only kvram_dots --batch 8

Configurations:
    keras_bf16      the model as built: plain `keras.Model`, `model.fit`.
    kvram_full      kvram.remat.rebuild: every decoder block a
                    `Checkpoint` (recomputed whole in the backward pass).
    kvram_dots      the same with `policy="save_dots"`: each block's
                    Dense/EinsumDense products kept, the rest recomputed.
    kvram_plan      `kvram.remat.plan(model, batch, budget)` with the
                    budget `--budget-gib` (XLA-checked), applied.
    kvram_attention kvram.speed.efficient_attention: KerasHub's attention
                    layers keep no n x n scores (the merged causal and
                    padding mask and the attention dropout go through kvram's
                    chunks), no checkpointing.
    kvram_attention_lean  the same with kvram.speed.lean_activations (the
                    LayerNormalizations keep their input alone).
    kvram_attention_dots  kvram_attention with save_dots per block.
    kvram_attention_chunk1024  kvram_attention with all 1024 keys in one chunk.
    kvram_attention_lean_chunk1024  the same with kvram.speed.lean_activations
                    (GPT-2's tanh-approximated GELUs and its norms keep their
                    inputs alone).
    kvram_model_attention_lean_chunk1024  the same model as a `kvram.Model`,
                    compiled with kvram's defaults (`steps_per_execution="auto"`:
                    16 batches a call here, as no callback sees every batch).
    keras_bf16_spe16  plain Keras compiled with `steps_per_execution=16`: what
                    the loop alone gives plain Keras.
    kvram_model_attention_lean_chunk1024_cublaslt  the same with XLA's
                    cuBLASLt GEMMs (`--xla_gpu_enable_cublaslt=true` added to
                    XLA_FLAGS; +3.5-4.6% on ViT-B/16).
    kvram_plan_attention_lean_chunk1024  what the transformers guide
                    recommends, then planned: efficient_attention (one chunk)
                    and lean_activations, then `kvram.remat.plan` to
                    `--budget-gib` (recomputing only what the budget needs),
                    applied (a `kvram.Model`, kvram's defaults).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import add_xla_flags, child_result, gpu_name, run_children, timed_fit, versions  # noqa: E402

SHAPE = dict(vocabulary_size=50257, num_layers=24, num_heads=16, hidden_dim=1024, intermediate_dim=4096,
             max_sequence_length=1024, dropout=0.1)
CONFIGS = {
    "keras_bf16": dict(kvram=None),
    "kvram_full": dict(kvram="blocks", policy="full"),
    "kvram_dots": dict(kvram="blocks", policy="save_dots"),
    "kvram_plan": dict(kvram="plan"),
    "kvram_attention": dict(kvram=None, attention=True),
    "kvram_attention_lean": dict(kvram=None, attention=True, lean=True),
    "kvram_attention_dots": dict(kvram="blocks", policy="save_dots", attention=True),
    "kvram_attention_chunk1024": dict(kvram=None, attention=True, chunk_size=1024),
    "kvram_attention_lean_chunk1024": dict(kvram=None, attention=True, chunk_size=1024, lean=True),
    "kvram_model_attention_lean_chunk1024": dict(kvram="model", attention=True, chunk_size=1024, lean=True),
    "kvram_model_attention_lean_chunk1024_cublaslt": dict(
        kvram="model", attention=True, chunk_size=1024, lean=True, xla_flags="--xla_gpu_enable_cublaslt=true"
    ),
    # with the XLA flags `import kvram` adds (kvram/_xla_flags.py FAST), which this bench otherwise leaves out
    "kvram_model_attention_lean_chunk1024_xlaflags": dict(
        kvram="model", attention=True, chunk_size=1024, lean=True,
        xla_flags="--xla_gpu_enable_cublaslt=true --xla_allow_excess_precision=false",
    ),
    "keras_bf16_spe16": dict(kvram=None, spe=16),
    "kvram_plan_attention_lean_chunk1024": dict(kvram="plan", attention=True, chunk_size=1024, lean=True),
}


def build(settings, batch, sequence, budget_gib):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    os.environ["KVRAM_XLA_FLAGS"] = "0"  # a configuration's own XLA flags alone, not those `import kvram` adds
    import kvram
    from kvram import remat

    kvram.precision.enable("mixed_bfloat16")
    if settings["kvram"] is None:  # plain Keras: its own einsum, not the one `import kvram` installs
        kvram.speed.tensordot_einsum(enable=False)
    keras.utils.set_random_seed(0)
    shape = dict(SHAPE, max_sequence_length=max(sequence, 1024))
    backbone = keras_hub.models.GPT2Backbone(**shape)
    logits = keras.layers.Dense(shape["vocabulary_size"], dtype="float32", name="lm_head")(backbone.output)
    model = keras.Model(backbone.input, logits, name="gpt2_medium")
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(0, shape["vocabulary_size"], (batch, sequence)), tf.int32),
         "padding_mask": tf.ones((batch, sequence), tf.int32)}
    y = tf.constant(rng.integers(0, shape["vocabulary_size"], (batch, sequence)), tf.int32)
    planning = {}
    if settings.get("attention"):
        planning["attention_layers"] = kvram.speed.efficient_attention(model, settings.get("chunk_size", 512))
    if settings.get("lean"):
        planning["lean_layers"] = kvram.speed.lean_activations(model)
    if settings["kvram"] == "blocks":
        chain = remat.segments(model)
        flags = [any(n.startswith("transformer_layer") for n in s.layers) for s in chain]
        model = remat.rebuild(model, [[i] for i in range(len(chain))], flags, policy=settings["policy"])
    elif settings["kvram"] == "plan":
        started = time.perf_counter()
        chosen = remat.plan(model, (x, y), int(budget_gib * 2**30),
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            optimizer=keras.optimizers.AdamW(1e-4))
        planning.update(plan_s=time.perf_counter() - started, plan=str(chosen))
        model = chosen.apply()
    elif settings["kvram"] == "model":
        model = kvram.Model(model.input, model.output, name=model.name)
    loop = {"steps_per_execution": settings["spe"]} if settings.get("spe") else {}  # else each Model's default
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
        **loop,
    )
    return model, tf.data.Dataset.from_tensors((x, y)).repeat(), planning


def run(name, batch, sequence, steps, warmup, budget_gib):
    settings = CONFIGS[name]
    add_xla_flags(settings)  # before XLA's first compilation
    import keras
    import tensorflow as tf

    model, data, planning = build(settings, batch, sequence, budget_gib)
    timed = timed_fit(model, data, steps, warmup, ["GPU:0"])
    return {
        "versions": {**versions(), "keras_hub": sys.modules["keras_hub"].__version__},
        "framework": f"tensorflow {tf.__version__}, keras {keras.__version__}",
        "settings": settings,
        "parameters": model.count_params(),
        "steps_per_execution": int(model.steps_per_execution or 1),
        "tokens_per_s": batch * sequence * timed["steps"] / timed["seconds"],
        "peak_gib": timed["peak_gib"]["GPU:0"],
        "final_loss": timed["loss"],
        **planning,
    }


def main():
    import argparse
    import json
    import platform

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=0.0, help="the kvram_plan* configurations' budget")
    parser.add_argument("--out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_result(run(args.child, args.batch, args.sequence, args.steps, args.warmup, args.budget_gib))
        return
    names = args.only or [n for n in CONFIGS if CONFIGS[n]["kvram"] != "plan" or args.budget_gib]
    results = run_children(
        __file__, names,
        ["--batch", args.batch, "--sequence", args.sequence, "--steps", args.steps, "--warmup", args.warmup,
         "--budget-gib", args.budget_gib],
        lambda r: f"{r['tokens_per_s']:9.0f} tokens/s  {r['peak_gib'] or 0:6.2f} GiB  loss {r['final_loss']:.3f}",
    )
    report = {
        "benchmark": "gpt2_medium-train", "gpu": gpu_name(), "python": platform.python_version(),
        "batch": args.batch, "sequence": args.sequence, "steps": args.steps, "warmup": args.warmup,
        "command": "python " + " ".join(sys.argv), "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
