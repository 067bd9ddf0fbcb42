"""Helpers shared by the benchmarks: timing a Keras fit and a PyTorch step, running each
configuration in its own process, and the result file every suite writes (`training_main`)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_xla_flags(settings: dict) -> None:
    """Appends a configuration's `xla_flags` to XLA_FLAGS; call it before
    TensorFlow starts (XLA reads the variable once)."""
    if settings.get("xla_flags"):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + settings["xla_flags"]).strip()


def set_kvram_switches(settings: dict) -> None:
    """Sets, before `import kvram`, whether a configuration takes what `import kvram`
    does by default (host memory pinned on a GPU, its XLA flags: docs/environment.md):
    kvram's configurations do, plain Keras's (`plain=True`) do not."""
    value = "0" if settings.get("plain") else "1"
    os.environ["KVRAM_PIN_HOST_MEMORY"] = os.environ["KVRAM_XLA_FLAGS"] = value


def cap_first_gpu(gib: float) -> None:
    """Limits TensorFlow's first GPU to `gib` GiB (one logical device with that
    memory limit), as a smaller card would; nothing where there is no GPU. Call
    it before TensorFlow first uses the GPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(gib * 1024))])


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        return out.stdout.strip()
    except OSError:
        return "unknown"


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("tensorflow", "keras", "keras_hub", "torch", "torchvision", "transformers"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = module.__version__
    if "torch" in sys.modules:  # the cuDNN it loaded: its attention's kernels depend on it
        found["torch_cudnn"] = sys.modules["torch"].backends.cudnn.version()
    return found


def torch_environment(environ=None) -> dict:
    """`environ` (default: this process's) for a PyTorch child, without the
    `LD_LIBRARY_PATH` folders that hold a cuDNN 9 library. PyTorch's wheel
    bundles its own cuDNN and finds it through its libraries' RUNPATH, which
    `LD_LIBRARY_PATH` comes before: with TensorFlow's staging on the GPU machine
    (../shared/gpu/tf-on-gpu.sh puts the image's cuDNN 9.14 first) PyTorch
    2.11 loaded 9.14 instead of its 9.19, and its attention ran
    FlashAttention-2 instead of cuDNN's."""
    import glob

    environ = dict(os.environ if environ is None else environ)
    kept = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d and not glob.glob(os.path.join(d, "libcudnn.so.9*"))]
    environ["LD_LIBRARY_PATH"] = ":".join(kept)
    return environ


def commit() -> str | None:
    """The commit measured: KVRAM_COMMIT where the caller sets it (the GPU machine's
    copy of the checkout has no git history), else git's HEAD here."""
    if os.environ.get("KVRAM_COMMIT"):
        return os.environ["KVRAM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() or None


_STARTED = {}


def started_commit() -> str | None:
    """The commit when this run started (first asked at import): a result written after a long
    run names the code that ran, not a HEAD that moved meanwhile."""
    if "commit" not in _STARTED:
        _STARTED["commit"] = commit()
    return _STARTED["commit"]


def result_header(benchmark: str, script: str) -> dict:
    """The fields every result file starts with: what ran, when, at which commit, and the command."""
    return {"benchmark": benchmark, "date": time.strftime("%Y-%m-%d"), "commit": started_commit(),
            "command": "python " + " ".join([os.path.relpath(script, ROOT), *sys.argv[1:]])}


def write_result(path: str | None, report: dict) -> None:
    """`report` as JSON at `path` (nothing where `path` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def whole_executions(steps: int, steps_per_execution: int) -> int:
    """`steps` rounded up to a multiple of `steps_per_execution` (Keras runs
    that many steps per call of its compiled function)."""
    return -(-steps // steps_per_execution) * steps_per_execution


def timed_fit(model, data, steps: int, warmup: int, devices=("GPU:0",), last_loss: bool = False) -> dict:
    """Runs `warmup` steps, then `steps` timed steps of `model.fit(data)`, both
    rounded up to whole executions of the model's `steps_per_execution`.

    Returns the timed steps, seconds for them (the clock stops after the last
    step's loss has been read, so queued GPU work is counted), the warm-up's
    steps and seconds (compilation included), that loss, the GiB in use on each of
    `devices` before the warm-up (weights, state: what stays between steps), the
    peak GiB TensorFlow allocated on each during the timed steps, and their
    wall-clock window (Unix seconds). The stage lines (stderr) say the first too, so
    that a run out of memory in its first step says what was resident.

    That loss is Keras's: the mean over the timed steps. With `last_loss`, the mean
    over the last execution's steps too (the last step's loss where
    `steps_per_execution` is 1), from the running means Keras passes to
    `on_train_batch_end`, which then waits for each execution.
    """
    import keras
    import tensorflow as tf

    times = {}
    started = time.perf_counter()

    def stage(message):  # on stderr, as kvram's stage lines: a run cut short says how far it got
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times["start"], times["start_epoch_s"] = time.perf_counter(), time.time()

        def on_epoch_end(self, epoch, logs=None):
            times["loss"] = float(logs["loss"])  # waits for the last step
            times["end"], times["end_epoch_s"] = time.perf_counter(), time.time()

    class Last(Clock):
        def on_epoch_begin(self, epoch, logs=None):
            times["means"] = [(0, 0.0)]  # (steps so far, their mean loss): Keras's running mean
            super().on_epoch_begin(epoch, logs)

        def on_train_batch_end(self, batch, logs=None):
            times["means"].append((batch + 1, float(logs["loss"])))

    spe = int(model.steps_per_execution or 1)
    if getattr(model, "_auto_steps_per_execution", False):  # kvram's "auto": what fit will take
        from kvram.training import _execution

        spe = _execution.steps_for(model, [Clock()], "train")
    steps, warmup = whole_executions(steps, spe), whole_executions(warmup, spe)

    def gib(device, key):
        try:
            return tf.config.experimental.get_memory_info(device)[key] / 2**30
        except ValueError:  # logical CPUs (a smoke run) keep no allocator statistics
            return None

    resident = {d: gib(d, "current") for d in devices}
    stage(f"warm-up: {warmup} steps (compilation included); in use before it: "
          + ", ".join(f"{d} {'n/a' if v is None else f'{v:.2f} GiB'}" for d, v in resident.items()))
    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0, callbacks=[Clock()])
    warmup_seconds = times["end"] - times["start"]
    stage(f"warm-up done: {warmup_seconds:.1f} s; timing {steps} steps")

    for device in devices:
        if gib(device, "peak") is not None:
            tf.config.experimental.reset_memory_stats(device)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Last() if last_loss else Clock()])
    stage(f"timed steps done: {times['end'] - times['start']:.1f} s")
    last = {}
    if last_loss:  # the last execution's steps: the difference of the last two running totals
        (n0, m0), (n1, m1) = times["means"][-2:]
        last = {"last_loss": (n1 * m1 - n0 * m0) / (n1 - n0), "last_loss_steps": n1 - n0}
    return {
        "steps": steps,
        "seconds": times["end"] - times["start"],
        "warmup_steps": warmup,
        "warmup_seconds": warmup_seconds,  # the first steps, compilation included
        "loss": times["loss"],
        "resident_gib": resident,
        "peak_gib": {d: gib(d, "peak") for d in devices},
        # wall-clock (Unix) seconds of the timed steps: whether processes run side by side overlapped there
        "timed_window": [times["start_epoch_s"], times["end_epoch_s"]],
        **last,
    }


def timed_torch_steps(step, steps: int, warmup: int) -> dict:
    """Runs `step()` (returns the loss tensor) `warmup` times, then `steps` timed
    times; returns seconds, the last loss, PyTorch's peak allocated GiB, and
    the first warm-up step's seconds (`torch.compile`'s compilation happens
    there; it is not in the timed steps)."""
    import torch

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    final = float(loss)
    sync()
    return {
        "seconds": time.perf_counter() - start,
        "loss": final,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "first_step_s": first,
    }


def image_runners(build_tf, torch_step) -> dict:
    """`training_main`'s runners of an image classifier's suite: `build_tf(settings, batch,
    device)` gives the compiled model and its data, `torch_step(settings, batch)` a PyTorch
    training step (returns its loss) and its model."""

    def run_tf(settings, args):
        add_xla_flags(settings)  # before TensorFlow starts
        import keras

        model, data = build_tf(settings, args.batch, args.device)
        timed = timed_fit(model, data, args.steps, args.warmup, [args.device])
        return {
            "img_per_s": args.batch * timed["steps"] / timed["seconds"],
            "peak_gib": timed["peak_gib"][args.device],
            "final_loss": timed["loss"],
            "timed_steps": timed["steps"],
            "steps_per_execution": int(model.steps_per_execution),
            "dtype_policy": keras.config.dtype_policy().name,
            "parameters": model.count_params(),
        }

    def run_torch(settings, args):
        step, model = torch_step(settings, args.batch)
        timed = timed_torch_steps(step, args.steps, args.warmup)
        return {
            "img_per_s": args.batch * args.steps / timed["seconds"],
            "peak_gib": timed["peak_gib"],
            "final_loss": timed["loss"],
            "first_step_s": timed["first_step_s"],
            "parameters": sum(p.numel() for p in model.parameters()),
        }

    return {"tf": run_tf, "torch": run_torch}


def stage_lines(text: str) -> list:
    """The stage lines in a child's stderr ("[   12.3 s] ..."): kvram's (remat.plan's, estimate's)
    and `timed_fit`'s."""
    return [line for line in text.splitlines() if re.match(r"\[\s*[0-9.]+ s\] ", line)]


def run_child(command, timeout=None, env=None, cwd=None) -> tuple[list, str | None, str]:
    """Runs `command`, a suite's child process. Returns the JSON records it printed (each on
    a line that starts with `RESULT `, or with `[worker I] RESULT ` under `kvram launch`), why it failed
    (None where it exited 0 with a record; else its output's tail, or the time limit it ran
    past followed by the last stage lines it printed, or the signal that ended it followed by
    those lines and the tail), and its stderr (so far, where it ran past the limit)."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return [], "\n".join([f"timed out after {timeout} s", *stage_lines(stderr)[-5:]]), stderr
    records = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if re.match(r"(\[worker \d+\] )?RESULT ", line)]
    if proc.returncode < 0:  # ended by a signal: its output's tail says nothing of that
        return records, "\n".join([_killed(proc.returncode), *stage_lines(proc.stderr)[-5:],
                                   (proc.stderr or proc.stdout)[-2000:]]), proc.stderr
    failed = proc.returncode or not records
    return records, (proc.stderr or proc.stdout)[-3000:] if failed else None, proc.stderr


def _killed(returncode: int) -> str:
    import signal

    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    why = " (on Linux, often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
    return f"killed by {name} (exit {returncode}){why}"


class HostMemoryWatch:
    """The least memory the host had available (Linux's MemAvailable) while the `with` block ran,
    read every `interval` seconds from a thread: where a child was killed for want of host memory,
    how close the host came. `least_gib` is None where /proc/meminfo is not read."""

    def __init__(self, interval: float = 1.0):
        self.interval, self.least_gib = interval, None

    def _sample(self):
        # read here, not through kvram.optimizers._host.available_host_bytes: importing kvram
        # imports TensorFlow, which a suite's parent process does not
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return
        gib = kib / 2**20
        self.least_gib = gib if self.least_gib is None else min(self.least_gib, gib)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        import threading

        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="host-memory-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def run_children(script: str, names, args, describe, timeout=None, environment=None, each=None) -> dict:
    """Runs `script --child NAME ARGS...` for each name, one process each (clean
    allocator statistics), and collects each one's record (`run_child`).
    `describe(result)` formats a line of progress; `timeout` (seconds), if
    given, stops a child that runs longer (its result is then the error);
    `environment(name)`, if given, is the child's environment (None: this
    process's); `each(results)`, if given, is called with the results so far
    after each child (a suite writes its file there: a run cut short keeps
    what ran)."""
    results = {}
    for name in names:
        started = time.perf_counter()
        records, error, stderr = run_child([sys.executable, script, "--child", name, *map(str, args)],
                                           timeout, environment(name) if environment else None)
        r = results[name] = {"error": error} if error else records[-1]
        stages = stage_lines(stderr)  # kept in the result
        if stages:
            r["stages"] = stages
        r["wall_s"] = time.perf_counter() - started
        text = f"FAILED: {r['error'][-400:]}" if "error" in r else describe(r)
        print(f"{name:26} {text}  ({r['wall_s']:.0f} s)", flush=True)
        if each:
            each(results)
    return results


def child_result(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _peak(value) -> str:
    """A peak in GiB for a progress line; "n/a" where the device keeps no allocator statistics."""
    return "   n/a" if value is None else f"{value:6.2f}"


def training_main(doc: str, script: str, benchmark: str, configs: dict, runners: dict, defaults: dict,
                  rate: str = "img_per_s", extra_arguments=None, describe_run=None):
    """The command line every training suite shares, and the result file it writes.

    `configs`: {name: (framework, label, settings)}; each configuration runs in its
    own process through `runners[framework](settings, args)`, which returns its
    measurement (`rate`, the throughput's key: "img_per_s", "tokens_per_s"; and
    `peak_gib`). `extra_arguments(parser)` adds a suite's own options;
    `describe_run(args)` adds keys that say what was run (its shape) to the file.

    The file (`--out`): the benchmark, the date, the commit, the GPU, the command,
    the batch, the steps, and per configuration its label, framework, settings,
    versions and measurement: the data the tables of README.md and
    docs/benchmarks.md are rendered from (`python -m benchmarks.report`)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--only", choices=sorted(configs), action="append",
                        help="one configuration (again for more; default: all)")
    parser.add_argument("--batch", type=int, default=defaults["batch"])
    parser.add_argument("--steps", type=int, default=defaults["steps"])
    parser.add_argument("--warmup", type=int, default=defaults["warmup"])
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0 for a smoke run)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per configuration")
    parser.add_argument("--out", default=None, help="the result file (JSON)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args()
    if args.child:
        framework, label, settings = configs[args.child]
        measured = runners[framework](settings, args)  # the frameworks are imported by now
        child_result({"label": label, "framework": framework, "settings": settings, "versions": versions(),
                      **measured})
        return
    report = {}

    def write(results):  # after each configuration
        report.update(_report(benchmark, script, rate, args, describe_run, results))
        write_result(args.out, report)

    run_children(
        script, args.only or list(configs), without_options(sys.argv[1:], ("--out", "--only")),
        lambda r: f"{r[rate]:9.0f} {rate.removesuffix('_per_s')}/s  {_peak(r['peak_gib'])} GiB  "
                  f"loss {r['final_loss']:.3f}",
        timeout=args.timeout,
        environment=lambda name: torch_environment() if configs[name][0] == "torch" else None,
        each=write,
    )
    return report


def _report(benchmark, script, rate, args, describe_run, results) -> dict:
    return {
        **result_header(benchmark, script),
        "gpu": gpu_name() if args.device.startswith("GPU") else f"none ({args.device}, a smoke run)",
        "rate": rate,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        **(describe_run(args) if describe_run else {}),
        "results": results,
    }


def without_options(argv, names) -> list:
    """`argv` without the options `names` and their values (`--out x`, `--out=x`)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in names:
            skip = True
            continue
        if any(item.startswith(f"{name}=") for name in names):
            continue
        kept.append(item)
    return kept


started_commit()  # at import, as the run starts
