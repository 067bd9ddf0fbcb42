"""LoRA on a Gemma-shaped KerasHub backbone under a GPU memory cap: does it train, and does remat.plan predict its peak?

Gemma 2B's shape (18 layers, hidden 2048, 8 query heads and 1 key/value head of 256,
intermediate 32768, vocabulary 256000: 2.5 B parameters), `backbone.enable_lora(--rank)`
(the query and value projections' factors are the only trainable weights), Keras's
`AdamW`, `mixed_bfloat16`; with `--base int8`, `backbone.quantize("int8")` first (int8 frozen
weights, as KerasHub's Gemma fine-tuning guide has them). How to run it: README.md.

    python benchmarks/optimizers/lora.py --layers 2 --hidden 64 --heads 2 --head-dim 32 \
        --intermediate 128 --vocabulary 512 --sequence 32 --steps 2 --warmup 1 --device CPU:0  # smoke run"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import cap_first_gpu, gpu_name, result_header, timed_fit, versions, write_result  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=16.0)
    parser.add_argument("--budget-gib", type=float, default=None, help="remat.plan's budget (default: cap - 0.5)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--base", choices=("float32", "int8"), default="float32",
                        help="the frozen weights: float32 (mixed_bfloat16's variables) or int8 (quantize('int8') "
                             "before enable_lora, as KerasHub's Gemma fine-tuning guide does)")
    parser.add_argument("--sequence", type=int, default=1024)
    # one row of 1024: the float32 weights (mixed_bfloat16: 10 GB) and the 256000-word logits and their
    # gradient in float32 (1 GB each per 1024 tokens) leave no room for a second row under 16 GiB
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=32768)
    parser.add_argument("--vocabulary", type=int, default=256000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0 for a smoke run: no cap)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    started = time.perf_counter()

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import kvram  # noqa: F401  (before TensorFlow: its XLA flags and allocator statistics)
    import tensorflow as tf

    if args.device.startswith("GPU"):
        cap_first_gpu(args.gpu_memory_gib)
    import keras
    import keras_hub
    import numpy as np

    from kvram import remat

    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=args.vocabulary, num_layers=args.layers, num_query_heads=args.heads,
        num_key_value_heads=args.kv_heads, hidden_dim=args.hidden, intermediate_dim=args.intermediate,
        head_dim=args.head_dim)
    if args.base == "int8":
        backbone.quantize("int8")
    backbone.enable_lora(args.rank)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(
        backbone.token_embedding(backbone.output, reverse=True))
    model = keras.Model(backbone.input, logits, name="gemma_causal_lm")
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, args.vocabulary, (args.batch, args.sequence)).astype("int32"),
         "padding_mask": np.ones((args.batch, args.sequence), "int32")}
    y = rng.integers(0, args.vocabulary, (args.batch, args.sequence)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    budget = None
    if args.device.startswith("GPU"):
        budget = int((args.budget_gib or args.gpu_memory_gib - 0.5) * 2**30)

    def optimizer():
        opt = keras.optimizers.AdamW(5e-5, weight_decay=0.01)
        opt.exclude_from_weight_decay(var_names=["bias", "scale"])
        return opt

    with tf.device(args.device):
        chosen = remat.plan(model, (x, y), budget, loss=loss, optimizer=optimizer(), jit_compile=True)
        planned_at = time.perf_counter()
        print(chosen, flush=True)
        trained = chosen.apply()
        trained.compile(optimizer=optimizer(), loss=loss, jit_compile=True)
        data = tf.data.Dataset.from_tensors((x, y)).repeat()
        timed = timed_fit(trained, data, args.steps, args.warmup, [args.device])
    measured = timed["peak_gib"][args.device]
    predicted = chosen.predicted_peak_bytes / 2**30
    parameters = int(model.count_params())
    trainable = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    result = {
        **result_header("optimizers-lora", __file__),
        "gpu": gpu_name() if args.device.startswith("GPU") else f"none ({args.device}, a smoke run)",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "parameters": parameters, "trainable_parameters": trainable,
        "budget_gib": None if budget is None else budget / 2**30,
        "recomputed_runs": [list(r) for r in chosen.runs], "segments": len(chosen.segments),
        "state_bytes": {k: int(v) for k, v in chosen.state.items()},
        "predicted_peak_gib": predicted, "plain_peak_gib": chosen.plain_peak_bytes / 2**30,
        "measured_peak_gib": measured,
        "predicted_over_measured": None if measured is None else predicted / measured,
        "tokens_per_s": args.batch * args.sequence * timed["steps"] / timed["seconds"],
        "final_loss": timed["loss"], "timed_window": timed["timed_window"], "plan_s": planned_at - started,
        "wall_s": time.perf_counter() - started, "versions": versions(),
    }
    print({k: result[k] for k in ("parameters", "trainable_parameters", "predicted_peak_gib", "measured_peak_gib",
                                  "predicted_over_measured", "tokens_per_s", "plan_s", "wall_s")}, flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
