"""`kvram plan`: will a model fit this GPU, and how (`kvram.remat.estimate`), its
estimate run in a child process started again from its kept checks when
TensorFlow aborts it."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import keras
import tensorflow as tf

from kvram import remat
from kvram.parallel import _launch
from kvram.remat._checker import CheckStore


def _model_builder(spec: str, input_shape, classes: int):
    """A no-argument function building the model `spec` names (never downloading weights)."""
    if spec.endswith(".keras"):
        if not os.path.exists(spec):
            raise SystemExit(f"kvram plan: --model {spec}: no such file")
        return lambda: keras.models.load_model(spec, compile=False)
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise SystemExit(f"kvram plan: --model {spec}: cannot import it ({error})") from None
        return function
    name = spec.removeprefix("keras.applications.")
    constructor = getattr(keras.applications, name, None)
    if constructor is None or not callable(constructor) or name[:1].islower():
        raise SystemExit(
            f"kvram plan: --model {spec}: not a keras.applications model. Allowed: a "
            "keras.applications name (ResNet50, keras.applications.ConvNeXtTiny, ...), a "
            "path to a .keras file, or module:function returning a model."
        )
    if input_shape is None:
        raise SystemExit("kvram plan: --input-shape is needed with a keras.applications model")
    return lambda: constructor(weights=None, input_shape=input_shape, classes=classes)


# How many times `kvram plan` starts its estimate's process again after it was
# killed by a signal, each time only if it had made a new check or died in one
# (a check out of memory that aborts the process costs two: CheckStore).
_PLAN_RESTARTS = 8


def _plan(args) -> int:
    try:
        memory_bytes = remat.parse_bytes(args.gpu_memory) if args.gpu_memory else None
    except ValueError as error:
        raise SystemExit(f"kvram plan: --gpu-memory: {error}") from None
    if args.limit_gpu and memory_bytes is None:
        raise SystemExit("kvram plan: --limit-gpu needs --gpu-memory (the size to limit the GPU to)")
    try:
        micro = None if args.micro_batch_sizes is None else [
            int(m) for m in args.micro_batch_sizes.split(",") if m.strip() != "none"]
    except ValueError:
        raise SystemExit(
            f"kvram plan: --micro-batch-sizes: {args.micro_batch_sizes!r}. Allowed: comma-separated "
            'row counts (e.g. 128,64), or "none" for whole batches only'
        ) from None
    if args.isolate == "always" or (args.isolate == "auto" and _launch.visible_gpus()):
        return _plan_in_child(args)
    if args.limit_gpu:
        try:
            if not limit_gpu(memory_bytes):
                raise SystemExit("kvram plan: --limit-gpu: TensorFlow sees no GPU")
        except RuntimeError as error:  # the GPU was initialized already
            raise SystemExit(f"kvram plan: --limit-gpu: {error}") from None
    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    build = _model_builder(args.model, shape, args.classes)
    try:
        found = remat.estimate(
            build, args.batch_size, memory_bytes=memory_bytes, optimizer=args.optimizer,
            precisions=tuple(args.precision.split(",")), margin=args.margin, micro_batch_sizes=micro,
            micro_batch_overhead=args.micro_batch_overhead, checks_file=args.checks_file,
            every_precision=args.every_precision, verbose=True,
        )
    except ValueError as error:
        raise SystemExit(f"kvram plan: {error}") from None

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found.to_json(), f, indent=2)

    # the estimate printed and saved before --measure trains (a process that
    # dies training keeps it)
    print(found, flush=True)
    save()
    if args.measure and found.recommended is not None:
        found.measured = remat.measure(
            build, found.recommended, args.batch_size, optimizer=args.optimizer, steps=args.steps
        )
        print(found.measured_line())
        save()
    code = 0 if found.recommended is not None else 1
    if args.plan_child:
        # Done: said in the checks file, and the process ends here, before
        # TensorFlow's teardown (its GPU allocator aborted one at exit, after
        # the estimate was printed: benchmarks/results/plan_h200/README.md).
        CheckStore(args.checks_file).finish(args.plan_child, code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def limit_gpu(memory_bytes: int) -> bool:
    """Makes the first GPU a logical device of `memory_bytes` (TensorFlow then
    allocates no more on it), before TensorFlow starts using it. False where
    TensorFlow sees no GPU; TensorFlow's RuntimeError where its runtime has
    started (the device can no longer change). `kvram plan --limit-gpu` and
    `kvram demo` use it."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_bytes // 2**20)])
    return True


def _kept_checks(path: str):
    """The checks file at `path` as `kvram.remat.estimate` reads it; empty where there is
    none yet or it is not one (the child then refuses it and says why)."""
    try:
        return CheckStore(path)
    except ValueError:
        return CheckStore(None)


def _plan_in_child(args) -> int:
    """Runs this `kvram plan` in a child process that keeps its checks in a
    file, and starts it again from them when a signal kills it: TensorFlow's
    GPU allocator can abort the process after a step that ran out of memory
    (`bfc_allocator.cc ... Check failed: h != kInvalidChunkHandle`, seen on an
    H200 limited to 8 GiB: benchmarks/results/plan_h200/README.md), and the
    checks made before are not made again (one that ran out of memory is
    kept as such)."""
    own = args.checks_file is None
    path = args.checks_file or os.path.join(tempfile.mkdtemp(prefix="kvram-plan-"), "checks.json")
    run = uuid.uuid4().hex
    command = [sys.executable, "-m", "kvram", *args.argv, "--isolate", "never", "--checks-file", path,
               "--plan-child", run]
    for restart in range(_PLAN_RESTARTS + 1):
        kept = _kept_checks(path)
        before, progress = len(kept.checks), kept.progress()
        code = subprocess.call(command)
        finished = _kept_checks(path).finished or {}
        if code < 0 and finished.get("run") == run:  # killed after it had finished
            print(f"kvram plan: the estimate's process {_launch._describe(code)} after it finished", file=sys.stderr)
            code = finished["code"]
        if code >= 0:  # it ended by itself: the estimate done, or refused
            if own:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            return code
        kept = _kept_checks(path)
        made = len(kept.checks)
        # a process that died in a check goes on: the check is tried again, and
        # taken as out of memory once a process has died in it twice
        if kept.progress() == progress or restart == _PLAN_RESTARTS:
            why = ("with no new check since it started" if kept.progress() == progress
                   else f"{restart + 1} times")
            print(f"kvram plan: the estimate's process {_launch._describe(code)} {why}; stopped. Its {made} "
                  f"check(s) are kept in {path}: `kvram plan ... --checks-file {path}` goes on from them.",
                  file=sys.stderr, flush=True)
            return 1
        during = (", in the check after them (tried again: one that a process dies in twice is out of "
                  "memory)" if kept.started else "")
        print(f"kvram plan: the estimate's process {_launch._describe(code)} after {made - before} new check(s)"
              f"{during} "
              "(TensorFlow's GPU allocator can abort a process after a step that ran out of memory); "
              f"starting it again from the {made} check(s) kept in {path} "
              f"(restart {restart + 1} of at most {_PLAN_RESTARTS})", file=sys.stderr, flush=True)
    return 1
