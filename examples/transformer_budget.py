"""Plan and train a KerasHub transformer under a memory budget with `kvram.remat.plan`.

    python examples/transformer_budget.py                      # a small GPT-2, CPU or GPU
    python examples/transformer_budget.py --layers 24 --hidden 1024 --heads 16 \\
        --sequence 1024 --batch-size 8 --vocabulary 50257 --budget 20GiB   # GPT-2-medium-shaped

The backbone is built from a config (`keras_hub.models.GPT2Backbone`, nothing
downloaded) with a Dense LM head. Its inputs are a dict, token ids and a
padding mask: `plan` cuts it at its decoder blocks and carries the mask beside
each cut. It measures one training step, chooses which blocks to recompute so
that training fits the budget with the least recomputation, and `apply()`
returns a `kvram.Model` on the same variables, which trains a few steps here
on random tokens; the allocator's peak is printed next to the budget.

`--lean` also applies `kvram.speed.lean_activations` (GELUs and LayerNorms
keep only their inputs; KerasHub's GPT-2 uses the tanh GELU, which stays, and
its LayerNorms change) before planning.
"""

from __future__ import annotations

import argparse

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram

import keras
import numpy as np
import tensorflow as tf

from kvram import memory, remat
from kvram.remat import parse_bytes


def build(args):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocabulary, num_layers=args.layers, num_heads=args.heads,
        hidden_dim=args.hidden, intermediate_dim=4 * args.hidden, dropout=0.1,
        max_sequence_length=args.sequence,
    )
    logits = keras.layers.Dense(args.vocabulary, dtype="float32", name="lm_head")(backbone.output)
    return keras.Model(backbone.input, logits, name="gpt2")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocabulary", type=int, default=512)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget", default=None,
                        help="memory for training, e.g. 20GiB (default: --fraction of the way from the least to the plain peak)")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--lean", action="store_true", help="kvram.speed.lean_activations first")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    before = memory.current_bytes()  # what this process held before: not training's
    model = build(args)
    if args.lean:
        kvram.speed.lean_activations(model)
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(1, args.vocabulary, (args.batch_size, args.sequence)), tf.int32),
         "padding_mask": tf.ones((args.batch_size, args.sequence), tf.int32)}
    y = tf.constant(rng.integers(0, args.vocabulary, (args.batch_size, args.sequence)), tf.int32)
    jit = bool(tf.config.list_logical_devices("GPU"))  # what Keras compiles with here, and plan checks
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = "adamw"

    # 1. Measure once: the least memory checkpointing reaches, and the plain peak.
    least = remat.plan(model, (x, y), loss=loss, optimizer=optimizer, jit_compile=jit)
    if args.budget is None:
        budget = int(least.minimum_peak_bytes + args.fraction * (least.plain_peak_bytes - least.minimum_peak_bytes))
    else:
        budget = parse_bytes(args.budget)
    # 2. The least recomputation within the budget (a budget below the least possible is refused).
    chosen = least.with_budget(budget)
    print(chosen)

    # 3. Train the planned model: the same variables as `model`.
    trained = chosen.apply()
    trained.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
    data = tf.data.Dataset.from_tensors((x, y))
    trained.fit(data, verbose=0)  # builds and compiles
    memory.reset_peak()
    history = trained.fit(data.repeat(args.steps), verbose=0)
    peak = memory.peak_bytes() - before
    print(f"budget {budget / 2**20:,.1f} MiB; predicted {chosen.predicted_peak_bytes / 2**20:,.1f} MiB; "
          f"measured while training {peak / 2**20:,.1f} MiB (all it allocated); "
          f"loss {history.history['loss'][-1]:.4f}")
    return chosen, budget, peak


if __name__ == "__main__":
    main()
