"""Step 4 of planning (`_plan`'s docstring): a choice checked by running the
training step as it will train (XLA-compiled, or on the graph executor), its
allocator peak measured; a step out of the device's memory is an
`_OutOfMemory`, not an error."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from statistics import median_low

import tensorflow as tf
from keras import tree
from keras.src.trainers.compile_utils import CompileLoss

from kvram import memory
from kvram._plan_process import STARTED, UNTUNED, _OutOfMemory
from kvram.remat._profile import peak_steps, traced_for_any_rows
from kvram.remat._segments import _groups, rebuild


def _batch(sample_batch):
    """(x, y) of a sample batch as tensors: x one array, or a dict or list of
    them (a model with several inputs: a list inside the (x, y) tuple, as a
    bare list is (x, y) itself); y None, one array, or a structure."""
    if isinstance(sample_batch, (tuple, list)):
        if not 1 <= len(sample_batch) <= 3:
            raise ValueError(
                "sample_batch must be x or a tuple (x, y) or (x, y, sample_weight). "
                f"Received a {type(sample_batch).__name__} of {len(sample_batch)} items."
            )
        x, y = sample_batch[0], (sample_batch[1] if len(sample_batch) > 1 else None)
    else:
        x, y = sample_batch, None
    x = tree.map_structure(tf.convert_to_tensor, x)
    first = tree.flatten(x)[0] if tree.flatten(x) else None
    if first is None or first.shape.rank is None or first.shape.rank < 1 or first.shape[0] == 0:
        raise ValueError(
            "sample_batch's x must have a batch dimension of >= 1 rows. Received shape "
            f"{None if first is None else first.shape}."
        )
    rows = first.shape[0]
    ragged = {tuple(t.shape) for t in tree.flatten(x) if t.shape.rank < 1 or t.shape[0] != rows}
    if ragged:
        raise ValueError(
            f"sample_batch's inputs must hold the same rows. Received: {rows} rows in the first, "
            f"shapes {sorted(ragged)} in others."
        )
    if y is None:
        return x, None
    y = tree.map_structure(tf.convert_to_tensor, y)
    first_y = tree.flatten(y)[0]
    if first_y.shape.rank is None or first_y.shape.rank < 1 or first_y.shape[0] != rows:
        raise ValueError(
            "sample_batch's x and y must hold the same rows, one target per sample. Received: x of "
            f"shape {tuple(first.shape)} ({rows} rows), y of shape {tuple(first_y.shape)}"
            f"{f' ({first_y.shape[0]} rows)' if first_y.shape.rank else ''}."
        )
    return x, y


def _rows(x) -> int:
    return int(tree.flatten(x)[0].shape[0])


def _loss_function(model, loss):
    """The planned step's loss of (y, the model's outputs): `loss` (default the
    model's compiled one, with its loss weights) as `compile()` takes it, a name,
    a callable, or a list or dict of them for a model with several outputs, as
    training computes it (Keras's `CompileLoss`, of its own: the model's keeps
    its loss trackers); else a mean square of every output."""
    weights = None
    if loss is None:
        loss = getattr(model, "loss", None)
        weights = getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)
    if loss is None:
        return lambda y, out: 0.5 * tf.add_n(
            [tf.reduce_mean(tf.square(tf.cast(o, "float32"))) for o in tree.flatten(out)])
    compiled = CompileLoss(loss, weights, output_names=getattr(model, "output_names", None))

    def loss_fn(y, out):
        if y is None:
            raise ValueError(
                "The loss to plan with needs targets: pass sample_batch=(x, y). Received: x alone, "
                f"with loss={loss!r}"
            )
        if not compiled.built:
            with tf.init_scope():  # its loss trackers made once, outside the traced step
                compiled.build(y, out)
        return compiled(y, out)

    return loss_fn


def _uses_xla(model, jit_compile, device) -> bool:
    if jit_compile == "auto":
        from keras.src.trainers.trainer import model_supports_jit

        return device.startswith("GPU") and model_supports_jit(model)
    if not isinstance(jit_compile, bool):
        raise ValueError(f'jit_compile must be True, False or "auto". Received: {jit_compile!r}')
    return jit_compile


class StageLog:
    """Stages of long planning work, each with the seconds since the start:
    kept in `lines`, and printed to stderr as they happen when `verbose`.
    The start is the log's making, or in a child process of `kvram plan` the
    command's (`KVRAM_PLAN_STARTED`, seconds since the epoch, set by its
    waiting process: `kvram._plan_process`)."""

    def __init__(self, verbose):
        self.verbose, self.lines = verbose, []
        started = os.environ.get(STARTED)
        self.start = time.time() if started is None else float(started)

    def __call__(self, message):
        self.lines.append((round(time.time() - self.start, 1), message))
        if self.verbose:
            print(f"[{self.lines[-1][0]:7.1f} s] {message}", file=sys.stderr, flush=True)


def _step_check(model, chain, x, y, loss_fn, device, jit, log=None, steps=None):
    """A function of runs returning the measured peak (bytes beyond the step's
    start) of the training step of `model` with those runs recomputed, as it
    will train: XLA-compiled (`jit`; one run after the compiling one, the
    compiling one's own where compiling allocates nothing on the device, or,
    on a GPU compiling untuned, no run: the compiled step's buffer assignment,
    `_step_peak_or_raise`: XLA fixes its buffers at compile time) or on the
    graph executor (the highest of three runs: its op order varies). Results
    are kept by runs; `log`, if given, is called with a line for each new
    check. `steps`, a dict, keeps each recomputation's model and traced step
    ({runs: (model, step)}): checks at other rows given the same dict reuse
    them, traced once for any rows."""
    done, settled_done = {}, {}
    steps = {} if steps is None else steps

    def trained(runs):
        """(the model recomputing `runs`, its traced training step)"""
        if runs not in steps:
            rebuilt = rebuild(model, *_groups(runs, len(chain))) if runs else model
            steps[runs] = (rebuilt, _training_step(rebuilt, x, y, loss_fn, jit))
        return steps[runs]

    def check(runs):
        runs = tuple(runs)
        if runs not in done:
            done[runs] = _step_peak(*trained(runs), x, y, device, jit)
            if log is not None:
                peak = done[runs]
                log(f"checked ({'xla' if jit else 'graph'}) with {len(runs)} recomputed run(s): "
                    + (f"out of memory (over {peak / 2**20:,.1f} MiB)" if isinstance(peak, _OutOfMemory)
                       else f"step peak {peak / 2**20:,.1f} MiB"))
        return done[runs]

    def settled(runs):
        """check(runs), for the peak a plan reports. Under one op order (the
        single-threaded executor) the median of three new traces, each of a
        model rebuilt for it: there a trace's peak repeats to the byte, step
        after step, but traces differ, most peaking at one value and a few
        higher or lower (MobileNetV3Small's least-memory plan on the CPU,
        five traces of one model: 42.0, 45.3, 42.0, 42.4, 42.0 MiB;
        ConvNeXtTiny's choice for a budget checked at 588.4 MiB, a new trace
        of it measured 511.5), and models rebuilt alike differ too (their
        layers' and ops' names differ; `Plan.apply()` gives the user a new
        one). The first check is left out: the least-memory runs are chosen
        by it, so a trace that peaked low is the likelier to be chosen. The
        residual chain's least-memory plan (CPU, batch 32), the median of its
        first check and two more traces of the planner's one model: 27.5 MiB;
        five models rebuilt from the plan then measured 30.1-33.0."""
        runs = tuple(runs)
        if runs not in settled_done:
            first = check(runs)
            peaks = []
            if not (jit or peak_steps() > 1 or isinstance(first, _OutOfMemory)):
                for _ in range(_TRACES):
                    rebuilt = rebuild(model, *_groups(runs, len(chain))) if runs else model
                    again = _step_peak(rebuilt, _training_step(rebuilt, x, y, loss_fn, jit), x, y, device, jit)
                    if not isinstance(again, _OutOfMemory):
                        peaks.append(again)
            settled_done[runs] = median_low(peaks or [first])  # of two: the lower
        return settled_done[runs]

    check.settled = settled
    # the runs checked so far, for a later budget's search (`_plan._fit_checked`)
    check.known = lambda: tuple(done)
    return check


# Traces a plan's reported peaks are the median of, under one op order (`settled` above).
_TRACES = 3


def _training_step(model, x, y, loss_fn, jit):
    """The training step `_step_peak` measures (its gradients, not applied), a
    `tf.function` for batches like x and y with any number of rows."""
    variables = model.trainable_variables

    def step(x, y=None):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # Returned, as a training step holds them until the optimizer applies them.
        return tape.gradient(loss, variables)

    return traced_for_any_rows(step, x, y, jit_compile=jit)


def _step_peak(model, step, x, y, device, jit) -> int:
    """The peak of `step` (`_training_step` of `model`) on (x, y), or an
    `_OutOfMemory`."""
    try:
        with memory.state_kept(model):  # the steps move BatchNormalization statistics and seeds
            return _step_peak_or_raise(model, step, x, y, device, jit)
    except tf.errors.ResourceExhaustedError:
        memory.collect_garbage()
        return _OutOfMemory(_free_bytes(device))


def _free_bytes(device) -> int:
    """Bytes free on `device` now, beside what is allocated (at least 1; 1
    where its limit is unknown): the floor of a step out of memory."""
    limit = memory.limit_bytes(device)
    return max(1, limit - memory.current_bytes(device)) if limit else 1


@contextlib.contextmanager
def new_garbage_only():
    """Within, Python's garbage collections (one before each check's trace,
    `_step_peak_or_raise`) scan only the objects made within: those alive on
    entry, after one collection, are out of the collector's sight
    (`gc.freeze`) until the end, unless the process had frozen objects
    already (then it is left as it is). On 2 cores a collection in a process
    holding TensorFlow and Keras alone (380k objects) took 0.35 s; planning
    MobileNetV3Small (batch 32, 64x64) and one budget spent 3.9 s in 7
    collections without this, 2.0 s in 9 with it (the plans differed)."""
    memory.collect_garbage()
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def _step_peak_or_raise(model, step, x, y, device, jit) -> int:
    """The peak of `step`, the training step of `model`, on (x, y)."""
    # Garbage first: tensors of earlier steps and traces that wait for the collector
    # stay allocated between the step's, and the allocator then counts some of the
    # step's buffers at the size of the larger free block it places them in. Measured on
    # the CPU under one op order, EfficientNetB0's least-memory plan (batch 32, 64x64),
    # each value the lower of two traces: 89.2-94.1 MiB in 10 of 12 measurements and
    # 104.3-105.8 in 2 without a collection before each trace; 80.5-87.9 MiB in 10 of 10
    # with one (another plan of the same model; MobileNetV3Small: no difference).
    memory.collect_garbage()
    if jit and _reads_assignment(device):
        return _assigned_bytes(step, x, y)
    if not (jit and _compiles_untuned(device)):
        gradients = step(x, y)  # traces (and compiles) the first time, compiles at new rows under XLA
        del gradients
    # else (the CPU) the compiling call's own run is the one measured: no kernel is timed
    # while compiling, so nothing but the step's own buffers is allocated on the device
    # (ResNet50, ConvNeXtTiny and MobileNetV3Small under XLA on the CPU: the first call's
    # peak equals each later call's to the byte, benchmarks/plan/compiling_call_peaks.py at commit 1fb3fe3).
    memory.reset_peak(device)
    start = memory.current_bytes(device)
    for _ in range(1 if jit else peak_steps()):
        gradients = None  # the previous step's are not held during the next
        gradients = step(x, y)
    peak = memory.peak_bytes(device) - start
    del gradients
    return peak


def _compiles_untuned(device) -> bool:
    """Whether XLA compiles for `device` without timing candidate kernels on
    it: on a CPU, and on a GPU with autotuning off (`--xla_gpu_autotune_level=0`
    in XLA_FLAGS, as `kvram plan`'s estimate sets, `_plan_process.UNTUNED`).
    With autotuning, compiling allocates the candidates' buffers on the GPU."""
    if memory._device_name(device).startswith("CPU"):
        return True
    name = UNTUNED.split("=")[0]
    levels = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.split("=")[0] == name]
    return bool(levels) and levels[-1] == UNTUNED


def _reads_assignment(device) -> bool:
    """Whether an XLA check reads the step's peak from XLA's buffer assignment
    instead of running the step: on a GPU compiling without autotuning
    (`_compiles_untuned`), where a run of the untuned step costs seconds (XLA
    then runs cuDNN's default convolution algorithms: 9.4 s for ResNet50's
    bfloat16 step at 128 rows on an H200 against 25 ms autotuned,
    benchmarks/plan/first_run_log.sh at commit 1fb3fe3) and the assignment's
    temporary buffer and outputs came to 0.998 (ResNet50, 128 rows) and 0.996
    (ConvNeXtSmall, 64 rows) of the run's measured peak
    (benchmarks/results/plan_buffer_assignment_peaks_h200.json). Not on the
    CPU, where XLA's runs of larger models allocate beyond their assignment
    (0.59-0.96 of the measured peak: plan_buffer_assignment_peaks_cpu.json)."""
    return memory._device_name(device).startswith("GPU") and _compiles_untuned(device)


def _assigned_bytes(step, x, y) -> int:
    """The bytes XLA assigns the jit-compiled `step` on (x, y) beyond its
    parameters: its preallocated temporary buffer and its outputs (what a run
    allocates on the device), from `_assignment`."""
    kinds = _assignment(step, x, y)
    return kinds["temp"] + kinds["outputs"]


def _assignment(step, x, y) -> dict:
    """Bytes of the compiled module's buffer assignment of the jit-compiled
    `step` on (x, y), by kind: "parameters" (the variables and the batch),
    "constants", "other" (thread-local: scalars in registers), "outputs",
    "temp". Compiles the step without running it
    (`experimental_get_compiler_ir`'s "optimized_hlo_proto_serialized": an
    `HloProto` with the assignment; TensorFlow documents the API for
    debugging, without a compatibility promise; TensorFlow's own tests of
    `recompute_grad` measure peak memory by it, on GPUs too)."""
    from tensorflow.compiler.xla.service import hlo_pb2

    proto = hlo_pb2.HloProto()
    arguments = (x,) if y is None else (x, y)
    proto.ParseFromString(step.experimental_get_compiler_ir(*arguments)(stage="optimized_hlo_proto_serialized"))
    kinds = dict.fromkeys(("parameters", "constants", "other", "outputs", "temp"), 0)
    for allocation in proto.buffer_assignment.buffer_allocations:
        if allocation.is_entry_computation_parameter:
            kinds["parameters"] += allocation.size
        elif allocation.is_constant:
            kinds["constants"] += allocation.size
        elif allocation.is_thread_local:
            kinds["other"] += allocation.size
        elif allocation.maybe_live_out:
            kinds["outputs"] += allocation.size
        else:
            kinds["temp"] += allocation.size
    return kinds
