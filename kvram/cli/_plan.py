"""`kvram plan`: will a model fit this GPU, and how (`kvram.remat.estimate`), its
estimate run in a child process started again from its kept checks when
TensorFlow aborts it (`kvram._plan_process`)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import zipfile

import keras
import tensorflow as tf

from kvram import _plan_process, _quiet, remat
from kvram._plan_process import CheckStore
from kvram.remat._check import StageLog


def _model_builder(spec: str, input_shape, classes: int):
    """A no-argument function building the model `spec` names (never downloading weights)."""
    if spec.endswith(".keras"):
        if not os.path.exists(spec):
            raise SystemExit(f"kvram plan: --model {spec}: no such file")
        if not zipfile.is_zipfile(spec):
            raise SystemExit(f"kvram plan: --model {spec}: not a .keras file (model.save writes a zip archive; "
                             f"this is {os.path.getsize(spec):,} bytes of something else)")
        return _checked(spec, "keras.models.load_model", lambda: keras.models.load_model(spec, compile=False))
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a module beside the user, as `python -m` finds it
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise SystemExit(f"kvram plan: --model {spec}: cannot import it ({error})") from None
        return _checked(spec, f"{function_name}()", function)
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
    return _checked(spec, f"keras.applications.{name}",
                    lambda: constructor(weights=None, input_shape=input_shape, classes=classes))


def _checked(spec: str, what: str, build):
    """`build`, ending the command with one line where it raises or makes no Keras model."""

    def checked():
        try:
            model = build()
        except Exception as error:  # noqa: BLE001 - the user's code: said in one line
            raise SystemExit(f"kvram plan: --model {spec}: {what} raised {type(error).__name__}: {error}") from None
        if not isinstance(model, keras.Model):
            raise SystemExit(f"kvram plan: --model {spec}: {what} returned {type(model).__name__}, not a Keras model")
        return model

    return checked


def _input_shape(text):
    """`--input-shape`'s H,W,C as ints, or the command's one-line error."""
    if text is None:
        return None
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise SystemExit(f"kvram plan: --input-shape {text}: expected positive integers separated by commas, "
                         "H,W,C for an image model (e.g. 224,224,3)")
    return shape


def _plan(args) -> int:
    if args.measure_when and not _plan_process.wait_to_go(args.measure_when):
        return _end(args, 0)  # the estimate failed or recommended nothing: nothing to measure
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
    if _plan_process.in_child(args.isolate):
        # (the `kvram` command is handed to _plan_process by kvram/__init__ before
        # it gets here; main() called from Python comes here)
        return _plan_process.supervise(args.argv, args.checks_file)
    if args.limit_gpu:
        try:
            if not limit_gpu(memory_bytes):
                raise SystemExit("kvram plan: --limit-gpu: TensorFlow sees no GPU")
        except RuntimeError as error:  # the GPU was initialized already
            raise SystemExit(f"kvram plan: --limit-gpu: {error}") from None
    _quiet.devices_set()
    build = _model_builder(args.model, _input_shape(args.input_shape), args.classes)
    if args.plan_child:  # what the estimate's process took to start, in the command's time
        StageLog(True)(f"TensorFlow {tf.__version__} imported"
                       + (f", GPU limited to {memory_bytes // 2**20:,} MiB" if args.limit_gpu else ""))
    if args.measure_from:
        return _end(args, _measure_from(args, build))
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
    if args.estimate_file and found.recommended is not None:
        # --measure in a process of its own, which compiles as training will (this
        # one's checks compile without XLA's autotuning: kvram._plan_process)
        with open(args.estimate_file, "w") as f:
            json.dump(found.to_json(), f)
    elif args.measure and found.recommended is not None:
        _measure(args, build, found)
        save()
    code = 0 if found.recommended is not None else 1
    if args.plan_child:
        # Done: said in the checks file (TensorFlow's teardown is skipped, see _end)
        CheckStore(args.checks_file).finish(args.plan_child, code)
    return _end(args, code)


def _end(args, code: int) -> int:
    """`code`; in a child of `kvram plan`'s own process, the process ends
    here, before TensorFlow's teardown (its GPU allocator aborted one at exit,
    after the estimate was printed: benchmarks/results/plan_h200/README.md at commit 1fb3fe3)."""
    if args.plan_child or args.measure_from:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _measure(args, build, found) -> None:
    """`--measure`: trains `found`'s recommendation (and plain Keras, where the
    estimate checked it) and prints what it measured."""
    # Plain Keras is trained beside the recommendation unless the estimate did not
    # check it (predicted over twice the limit): a compiled step that runs out of the
    # GPU's memory takes a compile's time, and TensorFlow's allocator can abort the
    # process after it (benchmarks/results/plan_minute_h200/README.md at commit 1fb3fe3).
    plain = found.plain_configuration()
    skipped = plain.not_checked if plain is not None else None
    chosen = found.recommended
    stage = StageLog(True)
    stage(f"--measure: training the recommendation ({chosen.precision}, micro-batch "
          f"{chosen.micro_batch_size or '-'}, {len(chosen.runs)} recomputed run(s))"
          + (", then plain Keras," if skipped is None else "")
          + f" for {args.steps} steps after one that compiles")
    found.measured = remat.measure(
        build, chosen, args.batch_size, optimizer=args.optimizer, steps=args.steps,
        plain=skipped is None, log=lambda line: stage(f"--measure: {line}"),
    )
    if skipped is not None:
        found.measured["plain"] = {"peak_bytes": None, "samples_per_second": None,
                                   "error": f"not run (out of memory as estimated: {skipped})"}
    print(found.measured_line(), flush=True)


def _measure_from(args, build) -> int:
    """`--measure` for the estimate that `kvram plan`'s estimate process wrote
    to `args.measure_from`; `--json`'s report gains what was measured."""
    with open(args.measure_from) as f:
        found = remat.Estimate.from_json(json.load(f))
    _measure(args, build, found)
    if args.json:
        with open(args.json) as f:
            report = json.load(f)
        report["measured"] = found.measured
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


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
