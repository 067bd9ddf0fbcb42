"""Plans trained in TensorFlow's default executor (the CPU, no XLA), as a user
trains them: keras.applications.MobileNetV2 at 64x64, batch 16 (the case of
the issue "kvram plan answers in a minute, and planning never changes the
user's model", item 3).

Each round builds the model afresh and measures, with Keras's fit() on the
CPU (jit_compile=False, as Keras compiles on a machine without a GPU):
- plain Keras;
- `kvram.remat.plan(model, batch).apply()`: no budget, the least memory;
- `plan.with_budget(0.7 x the plan's plain prediction).apply()`.
`--jit` plans and trains all three under XLA instead, for comparison.
`--profile-in-one-order` takes the planner's cut-by-cut measurement in one op order
(`tests.helpers.one_op_order`: the single-threaded executor), its checks and the training as
before. `--fuse-batch-norm` calls `kvram.speed.fuse_batch_norm` on the model before
planning (fused kernels keep less for the backward pass); plain Keras stays the
model as built.

A run's peak is the CPU allocator's peak over 6 steps after a warm-up fit,
above what was allocated before them (the variables and the optimizer's state
exist by then), plus the plan's resident bytes (variables, optimizer state,
batch), so that it compares with the plan's predictions and budget, which
count them. Writes JSON with every round and the medians.

    python benchmarks/plan/default_executor.py --rounds 3 --out default_executor_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics need TF's oneDNN allocator, on by default only on CPUs with
# AVX-512 VNNI/AMX; set before TensorFlow is imported, as `import kvram` and tests/conftest.py do
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import common  # noqa: E402

from kvram import memory, remat, speed  # noqa: E402

LOSS = "sparse_categorical_crossentropy"


@contextlib.contextmanager
def profiled_in_one_order():
    """Within, `remat.plan`'s cut-by-cut measurement runs in one op order."""
    from kvram.remat import _plan
    from tests.helpers import one_op_order

    def in_one_order(*args, **kwargs):
        with one_op_order():
            return profile(*args, **kwargs)

    profile, _plan._profile = _plan._profile, in_one_order
    try:
        yield
    finally:
        _plan._profile = profile


def fit_peak(model, x, y, jit=False, steps=6) -> int:
    model.compile(optimizer="adam", loss=LOSS, jit_compile=jit)
    model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), verbose=0)  # builds, traces
    memory.collect_garbage()
    start = memory.current_bytes("CPU:0")
    memory.reset_peak("CPU:0")
    model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(steps), verbose=0)
    return memory.peak_bytes("CPU:0") - start


def one_round(rows, size, fraction, jit=False, fuse=False, profile_in_one_order=False):
    def make():
        keras.utils.set_random_seed(0)
        return keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10)

    x = np.random.default_rng(0).random((rows, size, size, 3)).astype("float32")
    y = np.arange(rows) % 10
    started = time.perf_counter()
    model = make()
    if fuse:
        speed.fuse_batch_norm(model)
    with profiled_in_one_order() if profile_in_one_order else contextlib.nullcontext():
        least = remat.plan(model, (x, y), loss=LOSS, jit_compile=jit)
    planned_seconds = time.perf_counter() - started
    resident = least.resident_bytes
    budget = int(fraction * least.plain_peak_bytes)
    try:
        chosen = least.with_budget(budget)
    except ValueError as error:  # the budget is below the least this plan checked
        chosen, refused = None, str(error)
    plain = fit_peak(make(), x, y, jit) + resident
    none = fit_peak(least.apply(), x, y, jit) + resident
    record = {
        "plan_seconds": planned_seconds,
        "resident_bytes": resident,
        "plain_peak_bytes": plain,
        "plain_predicted_bytes": least.plain_peak_bytes,
        "no_budget_peak_bytes": none,
        "no_budget_predicted_bytes": least.predicted_peak_bytes,
        "no_budget_over_plain": none / plain,
        "budget_bytes": budget,
    }
    if chosen is None:
        return {**record, "budget_refused": refused}
    budgeted = fit_peak(chosen.apply(), x, y, jit) + resident
    return {**record, "budget_predicted_bytes": chosen.predicted_peak_bytes, "budget_peak_bytes": budgeted,
            "budget_peak_over_budget": budgeted / budget}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--fraction", type=float, default=0.7, help="the budget, as a fraction of plain")
    parser.add_argument("--jit", action="store_true",
                        help="plan, and train plain and planned, under XLA instead (for comparison)")
    parser.add_argument("--fuse-batch-norm", action="store_true",
                        help="kvram.speed.fuse_batch_norm on the planned model first")
    parser.add_argument("--profile-in-one-order", action="store_true",
                        help="the planner's cut-by-cut measurement in one op order (the single-threaded executor)")
    parser.add_argument("--out", default="default_executor_cpu.json")
    args = parser.parse_args(argv)
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(args.rows, args.size, args.fraction, args.jit, args.fuse_batch_norm,
                                args.profile_in_one_order))
        r = rounds[-1]
        budgeted = (f"peak {r['budget_peak_over_budget']:.3f}x it" if "budget_peak_over_budget" in r
                    else "refused: below the least memory the plan checked")
        print(f"round {i + 1}: no budget {r['no_budget_over_plain']:.3f}x plain "
              f"({r['no_budget_peak_bytes'] / 2**20:.1f} of {r['plain_peak_bytes'] / 2**20:.1f} MiB); "
              f"budget {r['budget_bytes'] / 2**20:.1f} MiB: {budgeted}", flush=True)
    numbers = {k for r in rounds for k, v in r.items() if isinstance(v, (int, float))}
    # a key's median over the rounds that have it (a refused budget has no peak)
    medians = {k: float(np.median([r[k] for r in rounds if k in r])) for k in sorted(numbers)}
    record = {"model": f"keras.applications.MobileNetV2 {args.size}x{args.size}, batch {args.rows}",
              "device": f"CPU:0, {'XLA (jit_compile=True)' if args.jit else 'default executor, jit_compile=False'}",
              "planner_profile": "in one op order" if args.profile_in_one_order else "default executor",
              "planned_batch_norm": "fused (kvram.speed.fuse_batch_norm)" if args.fuse_batch_norm else "as built",
              "rounds": rounds, "medians": medians}
    common.write_record(args.out, record)
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main()
