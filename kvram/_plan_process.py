"""The `kvram plan` command's own process when its estimate runs in a child
(`--isolate`, on a machine with a GPU by default): it starts the child, and
starts it again from the checks kept in the checks file when a signal kills it
(TensorFlow's GPU allocator can abort a process after a step that ran out of
memory: `bfc_allocator.cc ... Check failed: h != kInvalidChunkHandle`, seen on
an H200 limited to 8 GiB, benchmarks/results/plan_h200/README.md at commit 1fb3fe3).

This process only waits, so it imports nothing of TensorFlow: `kvram/__init__`
hands the command to `main()` here before it imports anything else. In
back-to-back runs on one H200, ResNet50's `kvram plan` took 63.4 s so against
77.1 s with TensorFlow imported and CUDA started here only to wait
(benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3).

Also here, for the same reason (no TensorFlow): the checks file (`CheckStore`,
which `kvram.remat`'s checker writes and this process reads), which GPUs are
visible (NVML), and how a child process ended.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from kvram import _quiet, _xla_flags


class _OutOfMemory(int):
    """A checked step that ran out of the device's memory: the bytes free when
    it started (a lower bound of its peak)."""

    def __repr__(self) -> str:
        return f"_OutOfMemory(at least {int(self):,})"


class CheckStore:
    """Checks' results kept in a JSON file (`estimate`'s checks_file), each
    written as soon as it is made (to a temporary file, then renamed: a
    process killed while writing leaves the previous file whole). Without a
    file, nothing is kept. `started`: the checks begun and not ended, each
    with the times a process began it and the memory free when it did (a
    process that dies in a check leaves it there). `finished`: which `kvram
    plan` child process finished the estimate, and its exit code (`finish`)."""

    def __init__(self, path, log=None):
        self.path, self.checks, self.started, self.finished, self.begun = path, {}, {}, None, 0
        if path and os.path.exists(path):
            try:
                with open(path) as f:
                    saved = json.load(f)
                self.checks, self.finished = dict(saved["checks"]), saved.get("finished")
                self.started, self.begun = dict(saved.get("started", {})), int(saved.get("begun", 0))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(
                    f"checks_file {path!r} is not a checks file kvram wrote ({error}). "
                    "Allowed: a file an earlier estimate wrote, or a path not yet there."
                ) from None
            if log is not None:
                log(f"{len(self.checks)} check(s) read from {path}")

    def get(self, key):
        """The check kept under `key` (`_Checker`'s), or None."""
        value = self.checks.get(key)
        if value is None:
            return None
        return _OutOfMemory(value["out_of_memory"]) if isinstance(value, dict) else int(value)

    def put(self, key, peak):
        self.checks[key] = {"out_of_memory": int(peak)} if isinstance(peak, _OutOfMemory) else int(peak)
        self.started.pop(key, None)
        self._save()

    def start(self, key, floor):
        """Says that the check `key` begins, with `floor` bytes free."""
        self.started[key] = {"times": self.died(key) + 1, "floor": int(floor)}
        self.begun += 1
        self._save()

    def died(self, key) -> int:
        """Times a process began the check `key` and did not end it."""
        return self.started.get(key, {}).get("times", 0)

    def progress(self) -> int:
        """Checks begun so far, by every process (ended or died in): what
        `kvram plan` counts to start a process again."""
        return self.begun

    def finish(self, run, code):
        """Says that the process `run` finished the estimate with exit `code`."""
        self.finished = {"run": run, "code": code}
        self._save()

    def _save(self):
        if not self.path:
            return
        _write_whole(self.path, json.dumps({"kvram_checks": 1, "checks": self.checks, "started": self.started,
                                            "begun": self.begun, "finished": self.finished}, indent=1))


def _write_whole(path: str, text: str) -> None:
    """Writes `text` to a temporary file, then renames it to `path`: a reader
    sees the file whole or not at all (a process killed while writing leaves
    the previous one)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def visible_gpus() -> list:
    """The GPU ids a worker may be given: `CUDA_VISIBLE_DEVICES`'s entries when it
    is set, else every GPU NVML counts (none without a driver or nvidia-ml-py)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: the workers use the CPU
        return []


def describe_exit(code: int) -> str:
    """How a child process ended, from its exit code (negative: a signal)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# How many times `kvram plan` starts its estimate's process again after it was
# killed by a signal, each time only if it had made a new check or died in one
# (a check out of memory that aborts the process costs two: CheckStore).
RESTARTS = 8


def _options(argv: list[str]):
    """(the command's name, the few `kvram plan` options this process reads)
    from the arguments after the program's name; the command's own parser
    (kvram.cli) reads them all, in the child."""
    words = [a for a in argv if a != "--verbose"]
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolate", default="auto")
    parser.add_argument("--checks-file", default=None)
    parser.add_argument("--plan-child", default=None)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    known, _ = parser.parse_known_args(words[1:])
    return (words[0] if words else None), known


def wanted(argv: list[str] | None = None) -> bool:
    """Whether this process is `kvram plan`'s waiting one: the `kvram` command
    (see `kvram._quiet.launched_as_command`) running `plan`, not as the child,
    with its estimate to run in a child (`--isolate always`, or auto with a
    GPU visible). False for `--help` and anything the parser would refuse,
    which the command's own parser then reports."""
    argv = sys.argv if argv is None else argv
    if not _quiet.launched_as_command(argv):
        return False
    name, known = _options(argv[1:])
    if name != "plan" or known.plan_child is not None or known.help:
        return False
    return in_child(known.isolate)


def in_child(isolate: str) -> bool:
    """Whether `kvram plan --isolate ISOLATE` runs its estimate in a child
    process: "always", or "auto" with a GPU visible."""
    return isolate == "always" or (isolate == "auto" and bool(visible_gpus()))


def main(argv: list[str] | None = None) -> int:
    """`kvram plan` as the waiting process (`wanted`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _, known = _options(argv)
    return supervise(argv, known.checks_file)


def _kept_checks(path: str) -> CheckStore:
    """The checks file at `path` as the estimate reads it; empty where there is
    none yet or it is not one (the child then refuses it and says why)."""
    try:
        return CheckStore(path)
    except ValueError:
        return CheckStore(None)


# XLA's autotuning picks the fastest kernels by running candidates: of
# ConvNeXtSmall's one check (batch 128 under 12GB on an H200), 51 s of the 86 s
# of HLO passes. A check is after the step's memory, not its speed: without
# autotuning that check took 56 s against 123 s and its step peaked at 8.72
# GiB against 8.75 (benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3).
UNTUNED = "--xla_gpu_autotune_level=0"

# Three more XLA flags that shorten a check's compile, each added unless XLA_FLAGS
# names it: LLVM without its expensive passes, dots as cuBLAS calls instead of
# Triton GEMM fusions (each a Triton, LLVM and PTX compile of its own), and no
# Triton normalization fusions. On one H200, two runs each against the default
# in turn, checks at autotuning level 0: ConvNeXtSmall's took 48.8 and 52.3 s
# against 63.2 and 59.1 s with the first two (step peak 8.75 GiB against 8.72;
# 8.75 autotuned, as training compiles it), ResNet50's 36.1 and 39.6 s against
# 41.1 and 39.1 s (4.71 GiB each), ViT-B's two 38.5 s against 45.7 s in one run
# (6.04 GiB against 6.12). The third: of the 33.3 s of HLO passes of
# ConvNeXtSmall's check, XLA's priority fusion took 28.5 s in its one call on
# the step. `triton-softmax-rewriter` makes normalizations (LayerNorm) Triton
# fusions (it compiled 42 candidate modules of its own there), and priority
# fusion searches Triton tilings for every producer or consumer of one
# (xla/service/gpu/transforms/priority_fusion.cc, `CanFuseTriton`). Without
# that pass priority fusion took 1.8 s, the check 20.7 s against 52.7 s, its
# step peaked at 8.76 GiB against 8.75, and the recommendation, trained, at
# 9.70 GiB (9.72 predicted). ResNet50's check peaked the same (4.72 GiB),
# ViT-B's at 5.99 GiB (6.04 in earlier runs)
# (benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3, 2026-11-28). XLA_FLAGS
# naming `--xla_disable_hlo_passes` keep their own list.
QUICK_COMPILE = ("--xla_llvm_disable_expensive_passes=true", "--xla_gpu_enable_triton_gemm=false",
                 "--xla_disable_hlo_passes=triton-softmax-rewriter")


# TensorFlow's executor, on which the cut-by-cut measurement runs, likewise times
# every cuDNN convolution algorithm for each shape it has not seen, in the first
# run of each probed step: on an H200, ConvNeXtSmall's took 21.6 s (16 rows) and
# 14.5 s (32) without it against 27.5 and 16.3 s with it, measuring the same
# within 1% (benchmarks/results/plan_minute_h200/8707064_probe_times/ at commit 1fb3fe3).
UNTUNED_CUDNN = "TF_CUDNN_USE_AUTOTUNE"

# The command's start (seconds since the epoch) for its children's stage lines
# (`kvram.remat._check.StageLog`): their times are then the command's.
STARTED = "KVRAM_PLAN_STARTED"


def checking_environment(environ=None) -> dict:
    """The estimate's child's environment: `environ` with XLA's autotuning off
    (`UNTUNED` added to XLA_FLAGS, unless XLA_FLAGS sets a level already),
    `QUICK_COMPILE`'s flags added where XLA_FLAGS does not name them, and
    TensorFlow's cuDNN autotuning off (`UNTUNED_CUDNN`=0, unless it is set)."""
    env = dict(os.environ if environ is None else environ)
    _xla_flags.add_unnamed((UNTUNED, *QUICK_COMPILE), env)
    env.setdefault(UNTUNED_CUDNN, "0")
    return env


def supervise(argv: list[str], checks_file: str | None) -> int:
    """Runs `kvram plan` with these arguments in a child process that keeps
    its checks in a file, and starts it again from them when a signal kills
    it; the checks made before are not made again (one that ran out of memory
    is kept as such). The child measures and compiles without autotuning
    (`checking_environment`); with `--measure`, the recommendation is then
    trained in a second child, whose steps are compiled and run as the user's
    training will be (the environment as given). That child starts beside
    the first and waits, TensorFlow imported, until told to go once the
    first has ended (`tell`, `wait_to_go`). Both children's stage lines
    count from this call (`STARTED`). The exit code of the last child."""
    started = {STARTED: repr(time.time())}  # both children's stage lines count from here
    own = checks_file is None
    path = checks_file or os.path.join(tempfile.mkdtemp(prefix="kvram-plan-"), "checks.json")
    run = uuid.uuid4().hex
    command = [sys.executable, "-m", "kvram", *argv, "--isolate", "never", "--checks-file", path,
               "--plan-child", run]
    estimate_file = None
    if _options(argv)[1].measure:
        estimate_file = os.path.join(tempfile.mkdtemp(prefix="kvram-plan-"), "estimate.json")
        command += ["--estimate-file", estimate_file]
    try:
        return _estimate_then_measure(argv, command, path, run, own, estimate_file, started)
    finally:
        if estimate_file is not None:
            shutil.rmtree(os.path.dirname(estimate_file), ignore_errors=True)


def _estimate_then_measure(argv, command, path, run, own, estimate_file, started) -> int:
    if estimate_file is None:
        return _estimate(command, path, run, own, checking_environment() | started)
    # --measure's process starts now and imports TensorFlow while the estimate
    # runs (12-14 s on the H200s, benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3);
    # it starts the GPU only once told to go, after the estimate's process ended
    go = f"{estimate_file}.go"
    measuring = subprocess.Popen(
        [sys.executable, "-m", "kvram", *argv, "--isolate", "never", "--measure-from", estimate_file,
         "--measure-when", go],
        env=dict(os.environ) | started | {PARENT: str(os.getpid())},
    )
    ready = False
    try:
        code = _estimate(command, path, run, own, checking_environment() | started)
        ready = code == 0 and os.path.exists(estimate_file)  # else failed, or nothing recommended
    finally:
        tell(go, ready)
        measured = measuring.wait()
    if not ready:
        return code
    code = measured
    if code < 0:
        print(f"kvram plan: the process training the recommendation for --measure {describe_exit(code)}; "
              "the estimate above stands", file=sys.stderr, flush=True)
        return 1
    return code


def tell(path: str, go: bool) -> None:
    """Tells the process waiting in `wait_to_go(path)` to go on, or to stop."""
    _write_whole(path, "go" if go else "stop")


# The waiting process's id, for --measure's process (`wait_to_go`).
PARENT = "KVRAM_PLAN_PARENT"


def wait_to_go(path: str, poll: float = 0.05) -> bool:
    """Waits until `tell(path, ...)`: True to go on, False to stop; also False
    once the process that would tell (`PARENT`, this process's parent) has
    ended."""
    parent = int(os.environ.get(PARENT, os.getppid()))
    while not os.path.exists(path):
        if os.getppid() != parent:
            return False
        time.sleep(poll)
    with open(path) as f:
        return f.read() == "go"


def _estimate(command, path, run, own, env) -> int:
    for restart in range(RESTARTS + 1):
        kept = _kept_checks(path)
        before, progress = len(kept.checks), kept.progress()
        code = subprocess.call(command, env=env)
        finished = _kept_checks(path).finished or {}
        if code < 0 and finished.get("run") == run:  # killed after it had finished
            print(f"kvram plan: the estimate's process {describe_exit(code)} after it finished", file=sys.stderr)
            code = finished["code"]
        if code >= 0:  # it ended by itself: the estimate done, or refused
            if own:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            return code
        kept = _kept_checks(path)
        made = len(kept.checks)
        # a process that died in a check goes on: the check is tried again, and
        # taken as out of memory once a process has died in it twice
        if kept.progress() == progress or restart == RESTARTS:
            why = ("with no new check since it started" if kept.progress() == progress
                   else f"{restart + 1} times")
            print(f"kvram plan: the estimate's process {describe_exit(code)} {why}; stopped. Its {made} "
                  f"check(s) are kept in {path}: `kvram plan ... --checks-file {path}` goes on from them.",
                  file=sys.stderr, flush=True)
            return 1
        during = (", in the check after them (tried again: one that a process dies in twice is out of "
                  "memory)" if kept.started else "")
        print(f"kvram plan: the estimate's process {describe_exit(code)} after {made - before} new check(s)"
              f"{during} "
              "(TensorFlow's GPU allocator can abort a process after a step that ran out of memory); "
              f"starting it again from the {made} check(s) kept in {path} "
              f"(restart {restart + 1} of at most {RESTARTS})", file=sys.stderr, flush=True)
    return 1
