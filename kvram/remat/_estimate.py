"""Will it fit, and at what cost? `kvram.remat.estimate` and `kvram plan`.

For each precision policy and micro-batch size, one model is built and its
training step is measured cut by cut (`kvram.remat.plan`'s measurement) at two
small batches; every byte count is then extrapolated linearly in the rows of
a slice (activations grow with the rows, variables do not), so a model whose
plain step would not fit the device can still be planned. For each
configuration the table gives the predicted peak without checkpointing, with
the least recomputation that fits the memory (less a margin), and with the
least memory, and the predicted step time relative to the whole batch without
checkpointing in the same precision: 1 + the recomputed FLOPs' fraction of a
step + `micro_batch_overhead` for each slice beyond the first (what precision
does to speed depends on the GPU and is measured by `--measure`).

The recommended configuration is the first that fits in this order: mixed
precision before float32 (the order of `precisions`), then the least
predicted step time (fewer slices first at equal time). A precision is
measured only when none before it has a configuration that fits (each is a
model built and measured at the probe batches: on an H200, 38.4 s for
ConvNeXtSmall at batch 128, benchmarks/results/plan_minute_h200/ at commit 1fb3fe3), unless
`every_precision` asks for the whole table.

Why a slice costs 5% of a step by default: on an H200 at batch 256 (224x224,
bf16, `benchmarks/results/plan_h200/ at commit 1fb3fe3`), two 128-row slices without
recomputation ran at 0.97-1.05x the whole batch's img/s (ResNet50,
ConvNeXtTiny, EfficientNetV2S) and four 64-row slices at 0.82-0.92x
(ResNet50, EfficientNetV2S), which a fixed cost per slice of about 5% of the
whole step fits (predicted time 1.05 and 1.15); the least recomputation that
fit 16 GiB ran at 0.92-0.94x (ResNet50, EfficientNetV2S; its FLOPs predicted
2-7%). Two slices without recomputation were faster than the whole batch
with recomputation in every such pair measured; this order prefers them where
the recomputation is predicted above 5% of a step.
Where slices are small enough to leave a GPU idle a slice costs more: give
`micro_batch_overhead`, or measure with `--measure`.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from kvram import memory
from kvram.optimizers import _host
from kvram.remat import _check as checking
from kvram.remat import _plan
from kvram._plan_process import CheckStore
from kvram.remat._check import StageLog
from kvram.remat._checker import Checker, _batch, _size
from kvram.remat._order import _first_that_fits, _probe_profiles, _scaled, _slices
from kvram.remat._segments import _functional, segments


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def parse_bytes(text) -> int:
    """'48GB' -> 48e9, '16GiB' -> 16 * 2**30, '1024' -> 1024 bytes."""
    raw = str(text).strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value > 0:
        raise ValueError(
            f"A memory size must be a positive number with an optional unit (B, KB, MB, GB, TB, "
            f"KiB, MiB, GiB, TiB), like 48GB or 16GiB. Received: {text!r}"
        )
    return int(value * _UNITS[unit])


@dataclasses.dataclass
class Configuration:
    """One row of the estimate (bytes are totals on the device)."""

    precision: str
    micro_batch_size: int | None
    remat: str  # "none", "fit" (least recomputation within the memory), "least"
    predicted_peak_bytes: int
    relative_step_time: float
    fits: bool
    plan: _plan.Plan | None = dataclasses.field(default=None, repr=False)
    # "executor": predicted from the graph executor's measurement; "xla" /
    # "graph": checked by steps as training will run them (XLA-compiled: on a
    # GPU its buffer assignment read, `_check._reads_assignment` / on the
    # graph executor), at the configuration's own rows or at the probe batches
    # extrapolated (`estimate`'s check_at); "oom": that check ran out of the
    # device's memory (the peak is then a lower bound, and it does not fit).
    predicted_by: str = "executor"
    executor_peak_bytes: int | None = None
    # Why the row was not checked (its prediction alone says it does not fit), or None.
    not_checked: str | None = None
    # The recomputed runs of a row read back from JSON (`Estimate.from_json`), which has no plan.
    runs_read: tuple = dataclasses.field(default=(), repr=False)

    @property
    def runs(self) -> tuple:
        """The recomputed runs ((first, last) segment indices): its plan's, or those read back."""
        return tuple(self.plan.runs) if self.plan is not None else self.runs_read


_NOT_IN_JSON = {"plan", "runs_read"}  # a row's runs are written apart, as "runs"


@dataclasses.dataclass
class Estimate:
    """What `estimate` found: every configuration, and the recommended one."""

    memory_bytes: int
    margin: float
    batch_size: int
    configurations: list
    recommended: Configuration | None
    measured: dict | None = None
    # How the configurations were checked ("batch" or "probes", see estimate's
    # check_at), and what was done when (seconds since the start, message).
    check_at: str = "probes"
    log: list = dataclasses.field(default_factory=list)
    # Precisions not measured: a configuration of one preferred to them fits
    # (`estimate`'s every_precision).
    not_estimated: list = dataclasses.field(default_factory=list)
    # Per precision: what stays beside the step, and its gradients (`remat.state_bytes`'s keys).
    state: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        # Fields read one by one: dataclasses.asdict would deep-copy each row's plan (its
        # model, profile and checks) only to drop it: 10.9 s for MobileNetV2 on 2 cores.
        rows = [
            {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in _NOT_IN_JSON}
            | {"runs": [list(r) for r in c.runs], "recommended": c is self.recommended}
            for c in self.configurations
        ]
        # Runs are segment indices: the last layer of each segment, per
        # precision, lets a reader of the JSON check it cuts the model the same.
        segments = {c.precision: [s.layers[-1] for s in c.plan.segments]
                    for c in self.configurations if c.plan is not None}
        return {"memory_bytes": self.memory_bytes, "margin": self.margin,
                "batch_size": self.batch_size, "check_at": self.check_at, "configurations": rows,
                "segments": segments, "measured": self.measured, "log": list(self.log),
                "not_estimated": list(self.not_estimated), "state": dict(self.state)}

    @classmethod
    def from_json(cls, report: dict) -> "Estimate":
        """An estimate from `to_json`'s report: every row as it was, its runs
        kept but no plan (enough for `measure` and the printed table)."""
        names = {f.name for f in dataclasses.fields(Configuration)} - _NOT_IN_JSON
        rows = [Configuration(**{n: row[n] for n in names},
                              runs_read=tuple(tuple(r) for r in row["runs"]))
                for row in report["configurations"]]
        recommended = next((c for c, row in zip(rows, report["configurations"]) if row["recommended"]), None)
        return cls(memory_bytes=report["memory_bytes"], margin=report["margin"],
                   batch_size=report["batch_size"], configurations=rows, recommended=recommended,
                   measured=report.get("measured"), check_at=report["check_at"],
                   log=[tuple(entry) for entry in report.get("log", [])],
                   not_estimated=list(report.get("not_estimated", [])), state=dict(report.get("state", {})))

    def __str__(self) -> str:
        rows = [
            f"batch {self.batch_size}; device memory {_size(self.memory_bytes)}, planned within "
            f"{_size((1 - self.margin) * self.memory_bytes)} (margin {self.margin:.0%})",
            f"{'precision':<16} {'micro-batch':>11} {'remat':>6} {'peak':>10} {'from':>8} {'rel. time':>9}  fits",
        ]
        for c in self.configurations:
            mark = "  <- recommended" if c is self.recommended else ""
            rows.append(
                f"{c.precision:<16} {c.micro_batch_size or '-':>11} {c.remat:>6} "
                f"{_size(c.predicted_peak_bytes):>10} {c.predicted_by:>8} {c.relative_step_time:>9.3f}  "
                f"{'yes' if c.fits else 'no'}{mark}"
            )
        if any(c.predicted_by != "executor" for c in self.configurations):
            where = ("at its own rows" if self.check_at == "batch"
                     else "at the probe batches, extrapolated")
            rows.append(f"from: xla / graph = checked by steps as training will run them (XLA-compiled: on a "
                        f"GPU its buffer assignment read, on a CPU run / run on the graph executor) {where}; "
                        "oom = that step ran out of the device's memory (the peak shown is a lower bound); "
                        "executor = predicted from the cut-by-cut measurement (over-predicts XLA's)")
        for precision, st in self.state.items():
            rows.append(f"{precision}: weights {_size(st['weights'])}, gradients {_size(st['gradients'])} "
                        f"(trainable weights only; micro-batches add as many in float32), optimizer state "
                        f"{_size(st['optimizer'])}, batches {_size(st['batches'])}; the rest of each peak is "
                        "activations")
        if self.recommended is None:
            rows += self._eight_bit_lines()
        if self.not_estimated:
            rows.append(f"not estimated: {', '.join(self.not_estimated)} (a preferred precision fits; "
                        "every_precision, or `kvram plan --every-precision`, estimates them too)")
        if self.recommended is None:
            rows.append("nothing fits: use a smaller batch (or more micro-batches)")
        if self.measured:
            rows.append(self.measured_line())
        return "\n".join(rows)

    def _eight_bit_lines(self) -> list:
        """Where nothing fits: what 8-bit moments would save under Adam or AdamW,
        and whether each precision's least-memory row would then fit; what
        `kvram.Model(host_offload=True)` would move to the host, and what the
        host would need for it beside what it has free; and the most that
        `kvram.Model(update_in_backward=True)` could save (predicted)."""
        lines, limit = [], (1 - self.margin) * self.memory_bytes
        for precision, st in self.state.items():
            least = min((c.predicted_peak_bytes for c in self.configurations if c.precision == precision
                         and c.remat == "least" and c.predicted_by != "oom"), default=None)
            if least is None:
                continue
            if "optimizer_8bit" in st:
                saved = st["optimizer"] - st["optimizer_8bit"]
                verdict = "fits" if least - saved <= limit else "still does not fit"
                lines.append(f"{precision} with 8-bit moments (--optimizer adamw8bit, kvram.optimizers.AdamW8bit): "
                             f"optimizer state {_size(st['optimizer_8bit'])} instead of {_size(st['optimizer'])}; "
                             f"the least-memory row would take {_size(least - saved)} and {verdict} (predicted, "
                             "not checked)")
            if st.get("optimizer") and "masters" in st:
                verdict = "fits" if least - st["optimizer"] <= limit else "still does not fit"
                rate = st.get("host_update_parameters_per_s")
                parameters = st["masters"] // 4
                took = (f"; the host's update of {parameters:,} parameters, measured on this host at "
                        f"{rate / 1e6:.0f}M parameters/s, adds {_duration(parameters / rate)} per update beside the copies"
                        if rate else "; the host update's time is not predicted")
                host = ""
                if "host_need" in st:
                    need, free, pinned = st["host_need"], st.get("host_available"), st.get("host_pinned_limit")
                    grouped = st.get("host_need_groups", need)
                    least_need = min(need, grouped)
                    host = (f"; the host needs {_size(need)} for it (HostOffload's defaults: the masters, the state, "
                            "a step's gradient copies, the update's working copies)")
                    if grouped < need:
                        host += (f", {_size(grouped)} with HostOffload(groups=k), k >= 2 (the update then works on "
                                 "one weight at a time)")
                    if free is not None:
                        host += f", and has {_size(free)} free"
                        if least_need > free:
                            host += ": too little, HostOffload would refuse it"
                    if pinned is not None and least_need > pinned:
                        host += (f"; host memory is pinned here, and TensorFlow's pinned allocator holds at most "
                                 f"{_size(pinned)}: set {_host.pinned_setting(least_need)} before TensorFlow starts")
                lines.append(f"{precision} with kvram.Model(host_offload=True): the optimizer state "
                             f"({_size(st['optimizer'])}) moves to host memory, beside "
                             f"{_size(st['masters'])} of float32 master weights; the least-memory row would take "
                             f"{_size(least - st['optimizer'])} and {verdict} (predicted, not checked{took}){host}")
            if st.get("gradients"):
                verdict = ("still does not fit" if least - st["gradients"] > limit
                           else "might fit: train to see")
                lines.append(f"{precision} with kvram.Model(update_in_backward=True): no step holds all "
                             f"{_size(st['gradients'])} of gradients; the least-memory row would take no less than "
                             f"{_size(least - st['gradients'])} and {verdict} (not checked)")
        return lines

    def plain_configuration(self) -> Configuration | None:
        """The row of plain Keras in the recommended precision: the whole batch,
        nothing recomputed (None without a recommendation)."""
        if self.recommended is None:
            return None
        return next((c for c in self.configurations if c.precision == self.recommended.precision
                     and c.micro_batch_size is None and c.remat == "none"), None)

    def measured_line(self) -> str:
        """What `measure` found for the recommendation (`measured`), in a line."""
        m, plain = self.measured, self.measured["plain"]
        return (f"measured, {m['steps']} steps on {m['device']}: recommended {_run(m)}, predicted "
                f"peak {_size(self.recommended.predicted_peak_bytes)}; plain Keras {_run(plain)}")


def _run(result) -> str:
    if result.get("error"):
        return result["error"]
    return f"peak {_size(result['peak_bytes'])}, {result['samples_per_second']:.1f} samples/s"


def estimate(
    build,
    batch_size: int,
    *,
    memory_bytes: int | None = None,
    optimizer="adam",
    loss=None,
    precisions=("mixed_bfloat16", "mixed_float16", "float32"),
    micro_batch_sizes=None,
    margin: float = 0.10,
    micro_batch_overhead: float = 0.05,
    probe_rows=None,
    jit_compile="auto",
    check_at="auto",
    checks_file=None,
    every_precision: bool = False,
    verbose: bool = False,
):
    """Predicted memory of every configuration (precision x checkpointing x
    micro-batch size) of a model, and the recommended one.

    Args:
        build: a function of no arguments returning the functional model; it is
            called once per precision with that global dtype policy set.
        batch_size: rows of the batch to train.
        memory_bytes: device memory to fit (default: the present GPU's total,
            else required).
        optimizer: the optimizer (name or instance) whose state is counted.
        loss: training loss (see `kvram.remat.plan`).
        precisions: dtype policies to try, in order of preference. One is
            measured only when no configuration of those before it fits,
            unless `every_precision`.
        micro_batch_sizes: slice sizes to try besides whole batches (default:
            the batch halved and quartered).
        margin: fraction of `memory_bytes` kept free.
        micro_batch_overhead: predicted step time added by each slice beyond
            the first, as a fraction of a whole-batch step (see the module's
            docstring for where 0.05 comes from).
        probe_rows: the two batch sizes measured (default: batch/8 and batch/4,
            at least 1 and 2).
        jit_compile: whether training will run under XLA (see
            `kvram.remat.plan`). Configurations are checked by steps run as
            training will (XLA-compiled or not) at the probe batches, in the
            order of preference until one fits; their peaks are those checks
            extrapolated, the others' the cut-by-cut prediction
            (`predicted_by` says which).
        check_at: where configurations are checked. "batch": at their own
            rows (the batch or the micro-batch): exact, one compiled step
            each, and a step that runs out of the device's memory does not
            fit (right when the device holds `memory_bytes`). "probes": at the
            two probe batches and at twice the larger one's rows (at most
            the configuration's own), extrapolated in rows, the higher of the
            two lines (three compiled steps each; for a target larger than
            the present device). "auto": "batch" on
            a GPU whose memory (its logical limit, else its total) is at least
            `memory_bytes`, else "probes".
        checks_file: a JSON file keeping every check's result as it is made,
            read first when it exists: an estimate started again after its
            process died (TensorFlow's GPU allocator can abort the process
            after a step that ran out of memory) reuses the checks already
            made. A check is reused only for the same model (name, input
            shape, segments), loss, precision, rows, XLA or not, runs,
            device and its memory limit, and TensorFlow, Keras and kvram
            versions.
        every_precision: measure every precision in `precisions`, for the
            table, also those after the one recommended (each a cut-by-cut
            measurement at the probe batches; none checked).
        verbose: print each stage as it ends, with the seconds since the start,
            on standard error (kept in `Estimate.log` either way).

    Returns:
        An `Estimate`.
    """
    if memory_bytes is None:
        memory_bytes = _device_total()
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1). Received: {margin!r}")
    if batch_size < 2:
        raise ValueError(f"batch_size must be >= 2. Received: {batch_size!r}")
    if not 0 <= micro_batch_overhead < 1:
        raise ValueError(f"micro_batch_overhead must be in [0, 1). Received: {micro_batch_overhead!r}")
    if micro_batch_sizes is None:
        micro_batch_sizes = sorted({m for m in (batch_size // 2, batch_size // 4) if 1 <= m < batch_size}, reverse=True)
    low_rows, high_rows = probe_rows or (max(1, batch_size // 8), max(2, batch_size // 4))
    if not 1 <= low_rows < high_rows:
        raise ValueError(f"probe_rows must be two increasing sizes >= 1. Received: {probe_rows!r}")
    exact = _checks_exact(check_at, memory_bytes)
    log = StageLog(verbose)
    store = CheckStore(checks_file, log)
    limit = int(memory_bytes * (1 - margin))
    previous = keras.config.dtype_policy().name
    configurations, done, skipped, recommended, states = [], set(), [], None, {}
    with checking.new_garbage_only():  # the checks' collections scan what the estimate makes
        try:
            for requested in precisions:
                if requested in done:
                    continue
                if recommended is not None and not every_precision:
                    # a configuration of a preferred precision fits: this one is not measured
                    skipped.append(requested)
                    continue
                keras.config.set_dtype_policy(requested)
                model = _functional(build())  # nested models inlined
                precision = _policy(model)
                if precision in done:
                    continue
                done.add(precision)
                if precision != requested:  # a loaded .keras model keeps its own: every precision builds it
                    done.update(precisions)
                rows_of, checker, states[precision] = _configurations(
                    model, precision, batch_size, micro_batch_sizes, (low_rows, high_rows), limit,
                    optimizer, loss, jit_compile, exact, log, store, micro_batch_overhead,
                )
                configurations += rows_of
                if recommended is None:
                    recommended = _first_that_fits(rows_of, checker, batch_size, limit, log)
        finally:
            keras.config.set_dtype_policy(previous)
    for c in configurations:
        c.__dict__.pop("_planning", None)
    if recommended is None and any(st.get("optimizer") for st in states.values()):
        # what host_offload's update would cost here: measured on this host's cores
        rate = _host.update_rate(_plan.optimizer_from(optimizer if optimizer is not None else "adam"))
        free, pinned = _host.available_host_bytes(), _host.pinned_host_limit()
        for st in states.values():
            st["host_update_parameters_per_s"] = rate
            if free is not None:
                st["host_available"] = free
            if pinned is not None:
                st["host_pinned_limit"] = pinned
    log("done" + (f": recommended {recommended.precision}, micro-batch "
                  f"{recommended.micro_batch_size or '-'}, remat {recommended.remat}" if recommended else
                  ": nothing fits"))
    return Estimate(memory_bytes, margin, batch_size, configurations, recommended,
                    check_at="batch" if exact else "probes", log=log.lines, not_estimated=skipped, state=states)


def _configurations(model, precision, batch_size, micro_batch_sizes, probe_rows, limit,
                    optimizer, loss, jit_compile, exact, log, store, micro_batch_overhead):
    """The rows of one precision (its model measured cut by cut at the probe
    batches; none checked yet) and its Checker."""
    low_rows, high_rows = probe_rows
    chain = segments(model)
    log(f"{precision}: built {model.name!r}, {len(chain)} segments")
    shape = tuple(model.inputs[0].shape[1:])
    batches = {rows: _batch(model, shape, rows) for rows in probe_rows}
    profiles = _probe_profiles(model, chain, batches, loss)
    log(f"{precision}: measured cut by cut at {low_rows} and {high_rows} rows")
    jit = checking._uses_xla(model, jit_compile, memory._device_name(None))
    checker = Checker(
        model, chain, batches, loss, jit, exact,
        lambda message, p=precision: log(f"{p}: {message}"),
        store, (precision, model.name, shape, [s.layers[-1] for s in chain], loss),
    )
    sample = int(np.prod(shape)) * 4 + 8  # float32 input and an int64 label per row
    # the whole batch, and on a GPU those prefetched, whatever the micro-batches
    state = _plan.state_bytes(model, optimizer, sample * batch_size, memory._device_name(None))
    fixed = state["weights"] + state["optimizer"] + state["batches"]
    eight_bit = _plan.eight_bit_alternative(optimizer)
    if eight_bit is not None:  # its state, for the table's line when nothing fits
        state["optimizer_8bit"] = _plan._optimizer_bytes(model, eight_bit)
    # host_offload's float32 master weights, and what HostOffload (its defaults) would need of the host, for
    # the same line
    state["masters"] = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    inner = _plan.optimizer_from(optimizer if optimizer is not None else "adam")
    state["host_need"] = _host.HostOffload(inner).required_host_bytes(model.trainable_variables)[0]
    try:  # with groups the update works on one weight at a time (refused where it needs every gradient)
        state["host_need_groups"] = _host.HostOffload(inner, groups=2).required_host_bytes(
            model.trainable_variables)[0]
    except ValueError:
        pass
    configurations = []
    for micro in [None] + list(micro_batch_sizes):
        rows = micro or batch_size
        profile = _scaled(*profiles, low_rows, high_rows, rows)
        # Micro-batches accumulate gradients in float32 beside the slice's own.
        accumulators = sum(_plan._nbytes(v) for v in model.trainable_variables) if micro else 0
        resident = fixed + accumulators
        base = _plan._plan_for(model, chain, profile, resident, None, rows)
        # A "fit" row wherever the plain step is predicted over the
        # limit, also where the least-memory one is: the checks search
        # for a choice within it (the executor's prediction
        # over-predicts XLA's), from the least-memory choice when
        # nothing is predicted to fit.
        names = ["none"] + (["fit"] if base.plain_peak_bytes > limit else []) + ["least"]
        for name in names:
            if name == "none":
                chosen = None
            elif name == "fit" and limit >= base.minimum_peak_bytes:
                chosen = base.with_budget(limit)
            else:
                chosen = base
            peak = base.plain_peak_bytes if chosen is None else chosen.predicted_peak_bytes
            extra = 0.0 if chosen is None else chosen.recompute_fraction
            slices = _slices(batch_size, micro)
            configurations.append(Configuration(
                precision, micro, name, peak, 1.0 + extra + micro_batch_overhead * (slices - 1),
                peak <= limit, chosen,
                predicted_by="executor", executor_peak_bytes=peak,
            ))
            configurations[-1]._planning = (model, chain, profile, resident, rows)
    return configurations, checker, state


def _checks_exact(check_at, memory_bytes) -> bool:
    """Whether configurations are checked at their own rows (`estimate`'s check_at)."""
    if check_at not in ("auto", "batch", "probes"):
        raise ValueError(f'check_at must be "auto", "batch" or "probes". Received: check_at={check_at!r}')
    if check_at != "auto":
        return check_at == "batch"
    device = memory._device_name(None)
    held = memory.limit_bytes(device) if device.startswith("GPU") else None
    # A logical GPU's limit is whole MiB (`kvram plan --limit-gpu` asks for memory_bytes // 2**20
    # MiB): a device limited to --gpu-memory 8GB holds 7,999,586,304 bytes, and was checked at the
    # probes (three compiled steps each) instead of one step at each configuration's rows.
    return held is not None and held >= memory_bytes // 2**20 * 2**20


def _policy(model) -> str:
    """The dtype policy most of `model`'s layers compute in."""
    names = [layer.dtype_policy.name for layer in model._flatten_layers(include_self=False)]
    return max(set(names), key=names.count) if names else keras.config.dtype_policy().name


def _device_total() -> int:
    if not tf.config.list_logical_devices("GPU"):
        raise ValueError("No GPU is visible: give the memory to plan for (memory_bytes, --gpu-memory 48GB).")
    monitor = memory.MemoryMonitor("GPU:0")
    total = monitor.snapshot().get("nvml_total_bytes")
    if total is None:
        raise ValueError(f"Could not read the GPU's memory ({monitor.nvml_note}): give --gpu-memory.")
    return int(total)
