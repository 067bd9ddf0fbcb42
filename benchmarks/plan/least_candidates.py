"""Which least-memory candidate `kvram.remat.plan` (no budget) takes, and what
each candidate's model peaks at when trained: keras.applications.MobileNetV2
at 64x64, batch 16, on the CPU in TensorFlow's default executor (the case of
the issue "kvram plan answers in a minute, and planning never changes the
user's model", item 3).

Each round plans a fresh model and records the candidates the plan checked
(`kvram.remat._plan._least_runs`: their number of recomputed runs and checked
step peak), marks the one it took, then trains each candidate with Keras's
fit() and measures its step peak as `default_executor.py` does (plain Keras
too). `ratio` counts the plan's resident bytes on both sides, as that script's
`no_budget_over_plain` does. `--check-steps` sets how many steps each check
is the highest of (3 in kvram).

    python benchmarks/plan/least_candidates.py --rounds 2 --out least_candidates_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics need TF's oneDNN allocator, on by default only on CPUs with
# AVX-512 VNNI/AMX; set before TensorFlow is imported, as `import kvram` and tests/conftest.py do
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402

import default_executor  # noqa: E402
from kvram import remat  # noqa: E402
from kvram.remat import _plan, _profile  # noqa: E402

MiB = 2**20


def one_round(rows, size) -> dict:
    seen = {}
    real = _plan._least_runs

    def spy(profile, check, candidates):
        chosen = real(profile, check, candidates)
        seen.update(candidates=[(runs, int(check(runs))) for runs in candidates], chosen=chosen)
        return chosen

    def make():
        keras.utils.set_random_seed(0)
        return keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10)

    x = np.random.default_rng(0).random((rows, size, size, 3)).astype("float32")
    y = np.arange(rows) % 10
    _plan._least_runs = spy
    try:
        least = remat.plan(make(), (x, y), loss=default_executor.LOSS, jit_compile=False, verbose=0)
    finally:
        _plan._least_runs = real
    resident = least.resident_bytes
    plain = default_executor.fit_peak(make(), x, y)
    candidates = []
    for runs, checked in seen["candidates"]:
        trained = default_executor.fit_peak(dataclasses.replace(least, runs=runs).apply(), x, y)
        candidates.append({"runs": len(runs), "taken": runs == seen["chosen"], "checked_step_mib": checked / MiB,
                           "trained_step_mib": trained / MiB, "ratio": (trained + resident) / (plain + resident)})
        print(candidates[-1], flush=True)
    return {"plain_step_mib": plain / MiB, "resident_mib": resident / MiB, "candidates": candidates}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--check-steps", type=int, default=_profile._PROFILE_STEPS,
                        help="steps each check (and each cut of the profile) is the highest of, in the default "
                             "executor (kvram.remat._profile._PROFILE_STEPS)")
    parser.add_argument("--out", default="least_candidates_cpu.json")
    args = parser.parse_args(argv)
    _profile._PROFILE_STEPS = args.check_steps
    rounds = [one_round(args.rows, args.size) for _ in range(args.rounds)]
    record = {"model": f"keras.applications.MobileNetV2 {args.size}x{args.size}, batch {args.rows}",
              "device": "CPU:0, default executor, jit_compile=False", "rounds": rounds}
    common.write_record(args.out, record)


if __name__ == "__main__":
    main()
