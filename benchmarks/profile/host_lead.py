"""What the host waits for in kvram's multi-step loop, and the loop's step time, without
the profiler (TensorFlow's profiler turns XLA's CUDA command buffers off, so
its host timeline is not the one training has).

For each configuration (of `benchmarks/vit/bench.py`, or `--model resnet50`'s
`benchmarks/resnet50/bench.py`), in its own process: build, compile, warm up with
`fit`, then call the model's compiled multi-step function
(`kvram.training._execution.multi_step_function`, `steps_per_execution` steps
a call) `--calls` times on the data path `fit` uses, timing

- `enqueue`: from the call until it returns;
- `done`: from the call until its loss has reached the host.

The call returns only after one `cuStreamSynchronize` at its end (its
outputs), so `enqueue` and `done` come out the same whether or not the host
waited for the GPU inside the call: they give the step time of a steady
multi-step call, not the host's lead. `--cuda-calls` shows the waits.

With `--cuda-calls`, each child runs with `cuda_calls.c` (built here with gcc)
preloaded: the CUDA driver calls TensorFlow and XLA made during the timed
calls (synchronizations, copies, kernel and graph launches, graph updates),
counted and timed a step, and the call stacks of the synchronizing calls
and device-to-host copies during one more call.

    python benchmarks/profile/host_lead.py --cuda-calls \
        --only kvram_cudnn_lean_nockpt --only kvram_cudnn_lean_nockpt_unguarded
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import add_xla_flags, child_result, gpu_name, run_children, timed_fit  # noqa: E402


def _configs(model):
    if model == "resnet50":
        from benchmarks.resnet50.bench import CONFIGS
    else:
        from benchmarks.vit.bench import CONFIGS
    return CONFIGS


def run(name, args) -> dict:
    framework, settings = _configs(args.model)[name]
    if framework != "tf":
        raise SystemExit(f"{name} is not a TensorFlow configuration")
    add_xla_flags(settings)
    if args.model == "resnet50":
        from benchmarks.resnet50.bench import build_tf

        model, data = build_tf(settings, args.batch, args.device, 224)
    else:
        from benchmarks.vit.bench import build_tf

        model, data = build_tf(settings, args.batch, args.device)
    warm = timed_fit(model, data, args.warmup, args.warmup, [args.device])
    multi = getattr(model.train_function, "multi_step", None)
    if multi is None:
        return {"error": "no kvram multi-step function (Keras's loop, or one step a call)", "settings": settings}
    iterator = iter(model._prefetched(data))
    spe = int(model.steps_per_execution)
    counters = _CudaCalls() if args.cuda_calls else None
    before = counters.snapshot() if counters else None
    enqueue, done = [], []
    for _ in range(args.calls):
        start = time.perf_counter()
        outputs = multi(iterator)
        returned = time.perf_counter()
        float(outputs.get_value()["loss"])
        finished = time.perf_counter()
        enqueue.append((returned - start) / spe * 1e3)
        done.append((finished - start) / spe * 1e3)
    extra = {}
    if counters:
        extra["cuda_calls_per_step"] = counters.per_step(before, counters.snapshot(), args.calls * spe)
        extra["sync_stacks"] = counters.stacks_of_syncs(lambda: float(multi(iterator).get_value()["loss"]))
    return {
        **extra,
        "settings": settings,
        "steps_per_call": spe,
        "warm_img_per_s": args.batch * warm["steps"] / warm["seconds"],
        "enqueue_ms_per_step": enqueue,
        "done_ms_per_step": done,
        "median_enqueue_ms_per_step": statistics.median(enqueue),
        "median_done_ms_per_step": statistics.median(done),
    }


class _CudaCalls:
    """The counters of `cuda_calls.c`, preloaded into this process."""

    def __init__(self):
        import ctypes

        self.lib = ctypes.CDLL(None)
        if not hasattr(self.lib, "cuda_calls_snapshot"):
            raise SystemExit("--cuda-calls: cuda_calls.so is not preloaded (LD_PRELOAD)")
        self.lib.cuda_calls_name.restype = ctypes.c_char_p
        self.buffer = (ctypes.c_longlong * 256)()

    def snapshot(self):
        n = self.lib.cuda_calls_snapshot(self.buffer)
        return {self.lib.cuda_calls_name(i).decode(): (self.buffer[i], self.buffer[n + i], self.lib.cuda_calls_seen(i))
                for i in range(n)}

    @staticmethod
    def per_step(before, after, steps):
        """{function: {"calls", "ms"} a step} for those called; `not_looked_up`: those
        the process never asked dlsym for (called some other way, or never)."""
        out = {name: {"calls": (after[name][0] - before[name][0]) / steps,
                      "ms": (after[name][1] - before[name][1]) / steps / 1e6}
               for name in after if after[name][0] > before[name][0]}
        out["not_looked_up"] = sorted(name for name in after if not after[name][2])
        return out

    def stacks_of_syncs(self, call, n=12):
        """The call stacks (`backtrace_symbols_fd`, on fd 2) of the first `n`
        synchronizing driver calls during `call()`."""
        with tempfile.TemporaryFile(mode="w+") as f:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(f.fileno(), 2)
            try:
                self.lib.cuda_calls_arm(n)
                call()
                self.lib.cuda_calls_arm(0)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            f.seek(0)
            return f.read()[-12000:]


def _build_cuda_calls() -> str:
    """Builds cuda_calls.so into a temporary folder; returns its path."""
    path = os.path.join(tempfile.mkdtemp(prefix="cuda_calls"), "cuda_calls.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", path, os.path.join(HERE, "cuda_calls.c"), "-ldl"],
                   check=True)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("vit", "resnet50"), default="vit")
    parser.add_argument("--only", action="append", help="a configuration (at least one)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0: smoke test)")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--cuda-calls", action="store_true",
                        help="count and time the CUDA driver calls (cuda_calls.c, preloaded; needs gcc)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_result(run(args.child, args))
        return
    if not args.only:
        parser.error("name at least one configuration with --only")

    def describe(r):
        return (f"enqueue {r['median_enqueue_ms_per_step']:6.1f} ms/step, done "
                f"{r['median_done_ms_per_step']:6.1f} ms/step (warm-up {r['warm_img_per_s']:.0f} img/s)")

    child_args = ["--model", args.model, "--batch", args.batch, "--warmup", args.warmup, "--calls", args.calls,
                  "--device", args.device]
    if args.cuda_calls:
        os.environ["LD_PRELOAD"] = _build_cuda_calls()  # the children's, inherited
        child_args.append("--cuda-calls")
    results = run_children(__file__, args.only, child_args, describe, timeout=args.timeout)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": f"host-lead-{args.model}", "gpu": gpu_name(), "batch": args.batch,
                       "command": "python " + " ".join(sys.argv), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
