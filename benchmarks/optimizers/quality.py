"""Final loss of kvram's optimizers against Keras's AdamW on a character-level language model.

Each optimizer starts from the same weights and sees the same batches of Python's own
standard library sources (no download); the `bf16_` configurations' logits are bfloat16
too, the loss float32. What it reports and how to run it: README.md."""

import argparse
import glob
import os
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import kvram  # noqa: E402, F401  (before TensorFlow)
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import result_header, write_result  # noqa: E402


def _adamw8bit(**options):
    return lambda lr: kvram.optimizers.AdamW8bit(lr, weight_decay=0.01, **options)


# name: (the weights' dtype policy, the optimizer at a learning rate). Under "bfloat16" every weight is
# bfloat16 (no float32 copy). Keras's AdamW computes its update in the weight's dtype, where beta_2=0.999
# rounds to 1.0 and its bias correction to 0: it never moves them (keras-team/keras-hub#2629,
# keras-team/keras#21238). AdamW8bit computes in float32 and rounds the result as its `rounding` says.
OPTIMIZERS = {
    "adamw": ("float32", lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.01)),
    "adamw8bit": ("float32", _adamw8bit()),
    "bf16_adamw": ("bfloat16", lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.01)),
    "bf16_adamw8bit_nearest": ("bfloat16", _adamw8bit(rounding="nearest")),
    "bf16_adamw8bit_kahan": ("bfloat16", _adamw8bit(rounding="kahan")),
    "bf16_adamw8bit_stochastic": ("bfloat16", _adamw8bit(rounding="stochastic")),
    "adamw8bit_factored": ("float32", _adamw8bit(factored=True)),
    "bf16_adamw8bit_factored_stochastic": ("bfloat16", _adamw8bit(factored=True, rounding="stochastic")),
}


def corpus(limit: int) -> np.ndarray:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(f, "rb").read() for f in files)[:limit]
    return np.frombuffer(data, np.uint8).astype("int32")


def train(name, args, text, seed=0):
    policy, optimizer = OPTIMIZERS[name]
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=256, num_layers=args.layers, num_heads=4,
                                             hidden_dim=args.hidden, intermediate_dim=4 * args.hidden,
                                             dropout=0.0, max_sequence_length=args.sequence)
    tokens = keras.Input((args.sequence,), dtype="int32")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    model = keras.Model(tokens, backbone.token_embedding(hidden, reverse=True))
    keras.config.set_dtype_policy("float32")
    model.compile(optimizer(args.learning_rate),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    rng = np.random.default_rng(seed + 1)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        rows = rng.integers(0, len(text) - args.sequence - 1, args.batch)
        window = np.stack([text[r:r + args.sequence + 1] for r in rows])
        losses.append(float(model.train_on_batch(window[:, :-1], window[:, 1:])))
    tail = losses[-max(1, args.steps // 10):]
    return {"final_loss": float(np.mean(tail)), "first_loss": losses[0], "wall_s": time.perf_counter() - start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--only", action="append", choices=sorted(OPTIMIZERS))
    parser.add_argument("--seeds", type=int, default=1, help="initialisations and batch orders, 0 .. N-1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    text = corpus(8 << 20)
    results = {}
    for name in args.only or OPTIMIZERS:
        runs = [train(name, args, text, seed) for seed in range(args.seeds)]
        results[name] = {"final_loss": float(np.mean([r["final_loss"] for r in runs])),
                         "final_losses": [r["final_loss"] for r in runs], "first_loss": runs[0]["first_loss"],
                         "wall_s": sum(r["wall_s"] for r in runs)}
        print(name, results[name], flush=True)
    for run in results.values():
        if "adamw" in results:
            run["final_loss_vs_adamw"] = run["final_loss"] / results["adamw"]["final_loss"]
    write_result(args.out, {**result_header("optimizers-quality", __file__), "machine": os.uname().machine,
                            "cpus": os.cpu_count(), "keras": keras.__version__, "settings": vars(args),
                            "corpus_bytes": len(text), "results": results})


if __name__ == "__main__":
    main()
