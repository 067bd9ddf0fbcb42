"""Where the time of `kvram plan`'s cut-by-cut measurement goes: building the
segments' models, tracing the probed step (once, for every probe batch), and
for each probe batch its first run (the runtime's graph optimization and
kernel selection) and the probed runs after it, as
`kvram.remat._profile._profile_steps` does them; and what the
probed runs measured (the highest stretch's peak, the sum of what segments
keep), to compare settings: TF_CUDNN_USE_AUTOTUNE=0 in the environment, or
`--grappler on|off`. (The results in
benchmarks/results/plan_minute_h200/8707064_probe_times/ and before traced
the step once per probe batch, with `parts_seconds` and `trace_seconds` per
probe.)

    python benchmarks/plan/probe_times.py --model ConvNeXtSmall --rows 16 32 --out probe_times.json
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kvram import memory  # noqa: E402
from kvram.remat import _check, _profile, _segments  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ConvNeXtSmall", help="a keras.applications name")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--grappler", choices=["kvram", "on", "off"], default="kvram",
                        help="kvram: as kvram measures (off on a GPU: "
                             "kvram.remat._profile.graph_optimizers_off); on; off: for the whole process "
                             "(tf.config.optimizer's disable_meta_optimizer)")
    parser.add_argument("--out", default="probe_times.json")
    args = parser.parse_args(argv)
    imported = time.perf_counter() - STARTED
    if args.grappler == "off":
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    keras.config.set_dtype_policy(args.policy)
    device = memory._device_name(None)
    started = time.perf_counter()
    model = getattr(keras.applications, args.model)(
        weights=None, input_shape=(args.size, args.size, 3), classes=args.classes)
    model = _segments._functional(model)
    chain = _segments._chain(model)
    loss_fn = _check._loss_function(model, "sparse_categorical_crossentropy")
    record = {"model": args.model, "device": device, "segments": len(chain),
              "import_seconds": imported, "build_seconds": time.perf_counter() - started,
              "grappler": args.grappler, "TF_CUDNN_USE_AUTOTUNE": os.environ.get("TF_CUDNN_USE_AUTOTUNE"),
              "TF_CUDNN_USE_FRONTEND": os.environ.get("TF_CUDNN_USE_FRONTEND"),
              "probes": []}
    rng = np.random.default_rng(0)
    batches = [(tf.constant(rng.random((rows, args.size, args.size, 3)).astype("float32")),
                tf.constant(rng.integers(0, args.classes, rows))) for rows in args.rows]
    optimizers = (_profile.graph_optimizers_off(device) if args.grappler == "kvram"
                  else contextlib.nullcontext())
    with memory.state_kept(model), _profile.shared_grouped_convolutions(device), optimizers:
        t = time.perf_counter()
        parts = [(s, _segments._part([s], f"{model.name}_segment{s.index}")) for s in chain]
        record["parts_seconds"] = time.perf_counter() - t
        # one trace for every probe batch, as kvram.remat._profile._profile_steps does
        step, records = _profile._probe_step(model, parts, *batches[0], loss_fn, model.trainable_variables, device)
        t = time.perf_counter()
        step.get_concrete_function()
        record["trace_seconds"] = time.perf_counter() - t
        for rows, (x, y) in zip(args.rows, batches):
            times = {"rows": rows}
            t = time.perf_counter()
            tf.nest.map_structure(lambda v: v.numpy(), step(x, y))
            times["first_run_seconds"] = time.perf_counter() - t
            runs, needs, kepts = [], [], []
            for _ in range(_profile.peak_steps()):
                t = time.perf_counter()
                kept, need, *_ = _profile._probe_run(lambda: step(x, y), records, device, len(chain))
                runs.append(time.perf_counter() - t)
                needs.append(max(need))
                kepts.append(sum(kept))
            times["later_runs_seconds"] = runs
            times["highest_need_bytes"] = needs
            times["kept_bytes"] = kepts
            record["probes"].append(times)
            print(json.dumps(times), flush=True)
    record.update(total_seconds=time.perf_counter() - started,
                  command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  python=platform.python_version(), tensorflow=tf.__version__, keras=keras.__version__,
                  date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
