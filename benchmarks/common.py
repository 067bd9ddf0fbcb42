"""Helpers shared by the benchmarks: timing a Keras fit, running each
configuration in its own process, and describing the machine."""

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
    """Sets, before `import kvram`, which of its defaults a configuration takes:
    host memory pinned on a GPU only where it pins (`pin`) or is the README's usage
    (`default`); kvram's XLA flags (kvram/_xla_flags.py) only for `default`, the
    others keeping their own `xla_flags` alone."""
    os.environ["KVRAM_PIN_HOST_MEMORY"] = "1" if settings.get("pin") or settings.get("default") else "0"
    os.environ["KVRAM_XLA_FLAGS"] = "1" if settings.get("default") else "0"


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
    for name in ("tensorflow", "keras", "torch", "torchvision"):
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
    2.11 loaded 9.14 instead of its 9.19, `torch.backends.cudnn.version()`
    raised, and its attention ran FlashAttention-2 instead of cuDNN's
    (benchmarks/results/profile_vit_pair_h200.json, torch_cudnn_env_h200.json)."""
    import glob

    environ = dict(os.environ if environ is None else environ)
    kept = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d and not glob.glob(os.path.join(d, "libcudnn.so.9*"))]
    environ["LD_LIBRARY_PATH"] = ":".join(kept)
    return environ


def write_record(path: str, record: dict) -> None:
    """Writes `record` as JSON to `path`, followed by what a result records of
    its run beside its numbers: the command (the script relative to the
    repository), the versions of Python and of the frameworks loaded
    (`versions`), the CPU count and the date."""
    record = {**record, "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), **versions(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)


def whole_executions(steps: int, steps_per_execution: int) -> int:
    """`steps` rounded up to a multiple of `steps_per_execution` (Keras runs
    that many steps per call of its compiled function)."""
    return -(-steps // steps_per_execution) * steps_per_execution


def track_gpu_frees(interval: int = 1) -> None:
    """Turns on TensorFlow's timestamped GPU allocator (`GPUOptions.Experimental.
    timestamped_allocator`, with a kernel-tracking event every `interval` GPU
    kernels, without which it does nothing). Call before TensorFlow's first
    operation.

    By default TensorFlow copies a tensor to the GPU only after every kernel
    queued on the compute stream so far (`SameWorkerRecvDone`'s
    `sync_dst_compute`: the copy's fresh buffer may be memory those kernels
    still read). A batch prefetched to the GPU therefore waits for the steps
    queued ahead of it, and the step that needs it waits for its copy. With
    the timestamped allocator such a buffer is only memory known to be free, and
    the copy does not wait (tensorflow/core/common_runtime/rendezvous_mgr.cc).
    """
    from kvram.speed import _configure_runtime

    def track(config):
        config.gpu_options.experimental.timestamped_allocator = True
        config.gpu_options.experimental.kernel_tracker_max_interval = interval

    _configure_runtime(track, "track_gpu_frees() must run before TensorFlow's first operation")


def timed_fit(model, data, steps: int, warmup: int, devices=("GPU:0",)) -> dict:
    """Runs `warmup` steps, then `steps` timed steps of `model.fit(data)`, both
    rounded up to whole executions of the model's `steps_per_execution`.

    Returns the timed steps, seconds for them (the clock stops after the last
    step's loss has been read, so queued GPU work is counted), that loss, and
    the peak bytes TensorFlow allocated on each of `devices` during them.
    """
    import keras
    import tensorflow as tf

    times = {}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times["start"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times["loss"] = float(logs["loss"])  # waits for the last step
            times["end"] = time.perf_counter()

    spe = int(model.steps_per_execution or 1)
    if getattr(model, "_auto_steps_per_execution", False):  # kvram's "auto": what fit will take
        from kvram.training import _execution

        spe = _execution.steps_for(model, [Clock()], "train")
    steps, warmup = whole_executions(steps, spe), whole_executions(warmup, spe)
    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0, callbacks=[Clock()])
    def peak_gib(device):
        try:
            return tf.config.experimental.get_memory_info(device)["peak"] / 2**30
        except ValueError:  # logical CPUs (a smoke run) keep no allocator statistics
            return None

    for device in devices:
        if peak_gib(device) is not None:
            tf.config.experimental.reset_memory_stats(device)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Clock()])
    return {
        "steps": steps,
        "seconds": times["end"] - times["start"],
        "loss": times["loss"],
        "peak_gib": {d: peak_gib(d) for d in devices},
    }


def timed_resident_steps(model, data, steps: int, warmup: int, devices=("GPU:0",)) -> dict:
    """`timed_fit`'s measurement with the batch kept on the device, as the PyTorch
    configurations keep theirs: no copy from the host a step. After a warm-up
    `fit` of `warmup` steps on `data` (which builds and compiles the model as
    training does), its first batch is copied to `devices[0]` once and
    `model.train_step` runs on it, XLA-compiled as `fit`'s step is,
    `steps_per_execution` steps a call of a `tf.function` loop: the step itself
    without `fit`'s data path, loop and callbacks.

    Returns the same keys as `timed_fit`."""
    import tensorflow as tf

    spe = int(model.steps_per_execution or 1)
    steps, warmup = whole_executions(steps, spe), whole_executions(warmup, spe)
    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0)  # builds and compiles as training does
    with tf.device(devices[0]):
        batch = tf.nest.map_structure(tf.identity, next(iter(data)))
    step = tf.function(model.train_step, jit_compile=bool(model.jit_compile))

    @tf.function
    def execution():
        logs = step(batch)
        for _ in tf.range(spe - 1):
            logs = step(batch)
        return logs

    for _ in range(warmup // spe):
        float(execution()["loss"])
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps // spe):
        logs = execution()
    loss = float(logs["loss"])  # waits for the last step
    seconds = time.perf_counter() - start
    return {
        "steps": steps,
        "seconds": seconds,
        "loss": loss,
        "peak_gib": {d: tf.config.experimental.get_memory_info(d)["peak"] / 2**30 for d in devices},
    }


def timed_torch_steps(step, steps: int, warmup: int) -> dict:
    """Runs `step()` (returns the loss tensor) `warmup` times, then `steps` timed
    times; returns seconds, the last loss, PyTorch's peak allocated GiB, and
    the first warm-up step's seconds (`torch.compile`'s compilation happens
    there; it is not in the timed steps)."""
    import torch

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    final = float(loss)
    torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - start,
        "loss": final,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_step_s": first,
    }


def run_children(script: str, names, args, describe, timeout=None, environment=None) -> dict:
    """Runs `script --child NAME ARGS...` for each name, one process each (clean
    allocator statistics), and collects the JSON each prints on a `RESULT` line.
    `describe(result)` formats a line of progress; `timeout` (seconds), if
    given, stops a child that runs longer (its result is then the error);
    `environment(name)`, if given, is the child's environment (None: this
    process's)."""
    results = {}
    for name in names:
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, script, "--child", name, *map(str, args)], capture_output=True, text=True,
                timeout=timeout, env=environment(name) if environment else None,
            )
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess([], 1, "", f"timed out after {timeout} s")
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not line:
            results[name] = {"error": (proc.stderr or proc.stdout)[-3000:]}
        else:
            results[name] = json.loads(line[-1][len("RESULT "):])
        # kvram's stage lines ("[   12.3 s] ..." on stderr: remat.plan's, estimate's), kept
        stages = [l for l in proc.stderr.splitlines() if re.match(r"\[\s*[0-9.]+ s\] ", l)]
        if stages:
            results[name]["stages"] = stages
        results[name]["wall_s"] = time.perf_counter() - started
        r = results[name]
        text = f"FAILED: {r['error'][-400:]}" if "error" in r else describe(r)
        print(f"{name:26} {text}  ({r['wall_s']:.0f} s)", flush=True)
        print(f"  {name} RESULT {json.dumps(r)}", flush=True)  # kept in logs if a later one stalls
    return results


def child_result(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _gib(value) -> str:
    """A peak in GiB for a summary line; "n/a" where the device keeps no allocator statistics."""
    return "   n/a" if value is None else f"{value:6.2f}"


def training_main(doc: str, script: str, benchmark: str, configs: dict, runners: dict, defaults: dict):
    """The command line shared by the image-training benchmarks: each
    configuration `name: (framework, settings)` runs in its own process through
    `runners[framework](settings, batch, steps, warmup, device)`."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--only", choices=sorted(configs), action="append")
    parser.add_argument("--batch", type=int, default=defaults.get("batch", 256))
    parser.add_argument("--steps", type=int, default=defaults.get("steps", 20))
    parser.add_argument("--warmup", type=int, default=defaults.get("warmup", 5))
    parser.add_argument("--device", default="GPU:0", help="TensorFlow device (CPU:0 for a smoke test)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        framework, settings = configs[args.child]
        child_result(runners[framework](settings, args.batch, args.steps, args.warmup, args.device))
        return
    results = run_children(
        script, args.only or list(configs),
        ["--batch", args.batch, "--steps", args.steps, "--warmup", args.warmup, "--device", args.device],
        lambda r: f"{r['img_per_s']:8.0f} img/s  {_gib(r['peak_gib'])} GiB  loss {r['final_loss']:.3f}",
        environment=lambda name: torch_environment() if configs[name][0] == "torch" else None,
    )
    report = {
        "benchmark": benchmark,
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "command": "python " + " ".join(sys.argv),
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def use_keras_loop(model) -> None:
    """`model` (a kvram.Model) runs Keras's own multi-step loop, whose condition
    sits on the GPU, instead of kvram's loop on the host: the A/B of
    `kvram.training._execution.multi_step_function`."""
    import keras

    model._make_function = lambda step_function: keras.Model._make_function(model, step_function)
