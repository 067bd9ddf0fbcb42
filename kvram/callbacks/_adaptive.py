"""`AdaptiveBatchSize`: sizes a `kvram.Model`'s micro-batch by memory during
`fit()`, and recovers from out-of-memory errors by running the same batch
again at a smaller one."""

from __future__ import annotations

import dataclasses
import logging
import time

import keras
from keras.src.utils import io_utils

from kvram import _checks, memory
from kvram.training import Model
from kvram.training._batch_statistics import least_rows


_log = logging.getLogger("kvram")


_MIB = 2.0**20


@dataclasses.dataclass
class BatchEvent:
    """One decision about the micro-batch size during `fit()`."""

    step: int
    epoch: int
    kind: str  # "probe", "start", "oom", "grow" or "shrink"
    old: int | None
    new: int
    peak_bytes: int | None = None
    predicted_bytes: int | None = None
    seconds_to_error: float | None = None
    seconds_to_recover: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Rows a batch needs before its first size is probed; the probes' sizes, as a
# share of the batch; the smallest gain worth a change of size (hysteresis).
_PROBE_MIN_ROWS = 32


_PROBE_SHARE = 32


_MIN_GAIN = 0.10


# A new slice shape's first run (cuDNN autotuning) is weighed against the time a
# larger slice saves only when it costs at least this many seconds.
_MIN_SHAPE_SECONDS = 1.0


def _slices(rows: int, size: int) -> list:
    """The slice sizes of a batch of `rows` rows at micro-batch `size`."""
    full, rest = divmod(rows, size)
    return [size] * full + ([rest] if rest else [])


def _shapes(rows: int, size: int) -> set:
    return set(_slices(rows, size))


def rungs(rows: int, low: int = 1, high: int | None = None, least_slice: int = 1) -> list:
    """The micro-batch sizes worth using for a batch of `rows` rows, largest first.

    A size m runs ceil(rows / m) slices; the smallest size with that many slices,
    ceil(rows / k), runs the same k slices, near-equal, with less memory. So the
    sizes are ceil(rows / k) for k = 1, 2, ... (about 2 * sqrt(rows) of them),
    within [low, high], and `low` itself; with `least_slice`, only sizes whose
    last slice has at least that many rows (where any does).
    """
    high = rows if high is None else min(high, rows)
    sizes = {-(-rows // k) for k in range(1, rows + 1)}
    sizes = {m for m in sizes if low <= m <= high}
    if low <= rows:
        sizes.add(low)
    whole = {m for m in sizes if rows % m == 0 or rows % m >= least_slice}
    return sorted(whole or sizes, reverse=True) or [max(1, min(low, rows))]


class AdaptiveBatchSize(keras.callbacks.Callback):
    """Sizes a `kvram.Model`'s micro-batch by memory, and recovers from OOM errors.

    Each batch from the data stays one optimisation step; this callback picks how
    many of its rows go through the forward and backward pass at once
    (`kvram.Model.micro_batch_size`), so the update is the same whatever it picks.

    - Sizes: always ceil(rows / k) for some number of slices k (`rungs`): a size
      between two of them runs as many slices as the smaller one, with more
      memory. The compiled step takes the size as an argument, so a change of
      size costs no retrace (only cuDNN's autotuning of the new slice shape).
    - First size: when the device's memory limit is known and a batch has at
      least 32 rows, two probes run the forward and backward pass on a few rows
      of the first batch at two small sizes (rows / 32 and twice that, each run
      twice so that autotuning is not measured), and every state they wrote is
      put back. Their peaks give the memory per micro-batch row and the memory
      that does not scale with it; the first size is the largest predicted to
      peak under `target_utilization` of the limit, so that out-of-memory
      errors, which TensorFlow takes tens of seconds to raise, are the exception.
    - New slice shapes: the first run of a slice shape autotunes its
      convolutions (on an H200, ~21 s for each shape of EfficientNetV2S). The
      probes' times give the cost of a new shape and the time of a slice; when
      a shape costs at least a second and the fit's length is known, a size
      whose shapes are new is taken (first size, growth, shrinking) only if it
      saves more than that cost over the remaining steps, else the largest
      fitting size whose shapes have run (for 512 rows and probes at 16 and 32:
      32, on 16 equal slices).
    - Out of memory during a step: the step's state is restored, memory freed,
      the micro-batch set back to the largest size that has completed a step
      (else the largest at most half the failed size) and **the same batch run
      again**, so no sample is skipped or seen twice and
      `optimizer.iterations` counts real updates only. The failing size
      becomes a ceiling: it is not tried again in this `fit()`. At
      `min_micro_batch` the batch is retried up to `max_retries` times in a
      row, then the error is raised with what was tried.
    - Headroom: after each step (but the first at a new size, which also
      autotunes) the device's peak is compared with the limit. Above halfway
      between `target_utilization * limit` and the limit, the micro-batch
      shrinks to the largest size predicted to peak under the target (a peak a
      little over the target keeps the size: each new size costs cuDNN's
      autotuning of its slices); below the target, it grows to the largest
      size predicted to fit, at most doubling, below any size that failed, and
      only for a gain of at least 10% (hysteresis: no change for a few rows). Predictions are linear in the
      micro-batch, with the probes' slope and each step's measured peak. The
      limit is `memory_limit`, else the logical GPU's `memory_limit`, else the
      GPU's total memory (NVML); on a CPU without `memory_limit` there is no
      prediction and only OOM errors shrink the micro-batch.

    Every decision is printed (with `verbose`), logged to the "kvram" logger and
    kept in `events` (see `MemoryLogger` for the CSV and plot).

    Args:
        min_micro_batch: int >= 1, the smallest micro-batch to try (raised to 2,
            and sizes leaving a one-row last slice avoided, for a model with a
            BatchNormalization over the batch axis alone: over one row its output
            is constant).
        max_micro_batch: None or int >= min_micro_batch; default: the batch size.
        target_utilization: float in (0, 1], the share of the limit a step may peak at.
        memory_limit: None or int bytes, overrides the detected device limit.
        device: None ("GPU:0" when a GPU is visible, else "CPU:0") or a device name.
        max_retries: int >= 0, OOM retries in a row at `min_micro_batch`.
        probe: bool, predict the first size from two small probes (when the
            limit is known); False starts at the whole batch.
        verbose: 0 or 1.

    Example:
    ```python
    model = kvram.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(data.batch(1024), callbacks=[kvram.callbacks.AdaptiveBatchSize()])
    ```
    """

    _kvram_controls_batch = True

    def __init__(
        self,
        min_micro_batch: int = 1,
        max_micro_batch: int | None = None,
        target_utilization: float = 0.85,
        memory_limit: int | None = None,
        device: str | None = None,
        max_retries: int = 3,
        probe: bool = True,
        verbose: int = 1,
    ):
        super().__init__()
        self.min_micro_batch = _checks.positive_int("min_micro_batch", min_micro_batch)
        self.max_micro_batch = _checks.positive_int(
            "max_micro_batch", max_micro_batch, allow_none=True
        )
        if self.max_micro_batch is not None and self.max_micro_batch < self.min_micro_batch:
            raise ValueError(
                "`max_micro_batch` must be >= `min_micro_batch`. Received: "
                f"min_micro_batch={min_micro_batch}, max_micro_batch={max_micro_batch}"
            )
        target = _checks.positive_float("target_utilization", target_utilization)
        if target > 1:
            raise ValueError(
                "`target_utilization` must be in (0, 1]. "
                f"Received: target_utilization={target_utilization!r}"
            )
        self.target_utilization = target
        self.memory_limit = _checks.positive_int("memory_limit", memory_limit, allow_none=True)
        self.device = memory._device_name(device)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"`max_retries` must be an int >= 0. Received: max_retries={max_retries!r}")
        self.max_retries = max_retries
        self.probe = _checks.boolean("probe", probe)
        self.verbose = verbose
        self.events: list[BatchEvent] = []
        self.oom_count = 0
        self._limit: int | None = None
        self._ceiling: int | None = None
        self._good: int | None = None
        self._rows = 0
        self._step = 0
        self._epoch = 0
        self._start_bytes = 0
        self._in_a_row = 0
        self._measure_next = True
        # Memory model: a step peaks at start + fixed + per_row * micro-batch.
        self._per_row: float | None = None
        self._fixed: float = 0.0
        # Time model (from the probes): a slice of m rows takes a + b * m seconds;
        # a slice shape's first run costs `_shape_seconds` more (autotuning).
        self._slice_seconds: tuple | None = None
        self._shape_seconds = 0.0
        self._seen: set = set()  # slice shapes (rows) that have run
        self._least_slice = 1  # rows a slice needs for the model's batch statistics (on_train_begin)
        self._clock = time.perf_counter

    # --- Keras callback hooks -------------------------------------------------
    def on_train_begin(self, logs=None):
        if not isinstance(self.model, Model):
            raise TypeError(
                "AdaptiveBatchSize needs a kvram.Model, whose training step can slice "
                f"batches and run one again. Received: a {type(self.model).__name__}"
            )
        self._limit = self.memory_limit or memory.limit_bytes(self.device)
        self._measure_next = False  # the first step also traces and compiles
        self._least_slice = least_rows(self.model)
        if self.min_micro_batch < self._least_slice:
            text = (f"AdaptiveBatchSize: min_micro_batch raised from {self.min_micro_batch} to "
                    f"{self._least_slice}: a BatchNormalization layer normalises over the batch axis alone, "
                    "and over one row its output would be constant")
            _log.info(text)
            if self.verbose:
                io_utils.print_msg(text)
            self.min_micro_batch = self._least_slice

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        memory.reset_peak(self.device)
        self._start_bytes = memory.current_bytes(self.device)

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        self._in_a_row = 0
        if self.model.micro_batch_size is not None and self._rows:
            self._seen |= _shapes(self._rows, self.model.micro_batch_size)
        peak = memory.peak_bytes(self.device)
        if not self._measure_next:
            self._measure_next = True
            return
        if self._limit is None:
            return
        size = self.model.micro_batch_size
        used = max(peak - self._start_bytes, 1)
        if self._per_row is None or self._per_row <= 0:
            self._per_row, self._fixed = used / size, 0.0  # proportional: no probe ran
        else:
            self._fixed = used - self._per_row * size  # the probes' slope, this step's level
        ladder = rungs(self._rows, self.min_micro_batch, self.max_micro_batch, self._least_slice)
        if peak > self._shrink_line() and size > self.min_micro_batch:
            fitting = [r for r in ladder if r < size and self._fits(r, self._start_bytes)]
            new = self._pick(fitting) if fitting else ladder[-1]
            self._ceiling = size if self._ceiling is None else min(self._ceiling, size)
            self._change("shrink", size, new, peak_bytes=peak,
                         predicted_bytes=self._predict(new, self._start_bytes))
            return
        if self._ceiling is None or size < self._ceiling:
            self._good = max(self._good or 0, size)
        fitting = [
            r for r in ladder
            if size < r <= 2 * size
            and (self._ceiling is None or r < self._ceiling)
            and self._fits(r, self._start_bytes)
        ]
        if (
            fitting
            and fitting[0] >= size * (1 + _MIN_GAIN)
            and self._pick([fitting[0], size], say=False) != size  # worth its new slice shapes
        ):
            self._change("grow", size, fitting[0], peak_bytes=peak,
                         predicted_bytes=self._predict(fitting[0], self._start_bytes))

    # --- called by kvram.Model's training function ----------------------------
    def begin_step(self, model, rows: int, probe=None, input_bytes: int = 0) -> int:
        """The micro-batch for a batch of `rows` rows (per replica).

        `probe(size, rows_used) -> bool` runs the gradient pass on `rows_used`
        rows at micro-batch `size` and puts every state back (False: out of
        memory); `input_bytes` is the batch's size in bytes.
        """
        self._rows = max(self._rows, rows)
        if model.micro_batch_size is None:
            ladder = rungs(rows, self.min_micro_batch, self.max_micro_batch, self._least_slice)
            size, predicted = ladder[0], None
            if self._can_probe(rows, probe):
                size, predicted = self._first_size(rows, ladder, probe, input_bytes / rows)
            self._change("start", None, size, predicted_bytes=predicted)
        return model.micro_batch_size

    def recover(self, model, error, size: int, rows: int, seconds: float) -> int:
        """After an OOM at `size`: the micro-batch to run the same batch with."""
        started = time.perf_counter()
        self.oom_count += 1
        effective = min(size, rows)
        self._ceiling = effective if self._ceiling is None else min(self._ceiling, effective)
        if self._per_row and self._limit:
            # The step needed more than the limit: no prediction may say it fits.
            self._fixed = max(self._fixed, self._limit - self._start_bytes - self._per_row * effective)
        if effective <= self.min_micro_batch:
            self._in_a_row += 1
            if self._in_a_row > self.max_retries:
                raise RuntimeError(
                    f"Out of memory at the smallest micro-batch ({self.min_micro_batch} "
                    f"rows), {self._in_a_row} times in a row (epoch {self._epoch + 1}, "
                    f"step {self._step + 1}). The model, its gradients and its optimizer "
                    "state do not fit with even that; checkpoint more layers "
                    "(kvram.layers.Checkpoint), use mixed precision, or lower "
                    "min_micro_batch. Weights and optimizer state are as after the "
                    "last completed step."
                ) from error
            new = effective
        elif self._good is not None and self._good < effective:
            new = max(self.min_micro_batch, self._good)  # the largest size that worked
        else:
            new = self._at_most(rows, effective // 2)
        self._change("oom", size, new, seconds_to_error=seconds)
        self.events[-1].seconds_to_recover = time.perf_counter() - started
        return new

    # ---------------------------------------------------------------------------
    def _can_probe(self, rows, probe) -> bool:
        if not self.probe or probe is None or self._limit is None or rows < _PROBE_MIN_ROWS:
            return False
        return 4 * max(self.min_micro_batch, rows // _PROBE_SHARE) <= rows

    def _first_size(self, rows, ladder, probe, input_row):
        """(first size, its predicted peak) from two probes at p and 2p rows of
        micro-batch, each on two slices (so the gradient sum is counted)."""
        p = max(self.min_micro_batch, rows // _PROBE_SHARE)
        used, seconds = {}, {}
        for size in (p, 2 * p):
            seconds[size] = []
            for _ in range(2):  # the first run of a shape also autotunes: not measured
                memory.reset_peak(self.device)
                start = memory.current_bytes(self.device)
                started = self._clock()
                previous, self.model._micro_batch_size = self.model._micro_batch_size, size
                try:
                    fits = probe(size, 2 * size)
                    peak = memory.peak_bytes(self.device)
                finally:
                    self.model._micro_batch_size = previous
                seconds[size].append(self._clock() - started)
                if not fits:
                    self.oom_count += 1
                    self._ceiling = size
                    new = self._at_most(rows, size // 2)
                    self._change("oom", size, new, seconds_to_error=self._clock() - started)
                    return new, None
            used[size] = peak - start
            self._change("probe", None, size, peak_bytes=peak, quiet=True)
        # Two probes, 2p and 4p rows of input: the step's input counts apart.
        per_row = (used[2 * p] - used[p]) / p - 2 * input_row
        if per_row <= 0:
            per_row = used[2 * p] / (2 * p)  # flat measurements: proportional, cautious
            fixed = 0.0
        else:
            fixed = used[p] - per_row * p - 2 * p * input_row
        self._per_row, self._fixed = per_row, fixed + input_row * rows
        self._time_model(p, seconds)
        start = memory.current_bytes(self.device)
        fitting = [r for r in ladder if self._fits(r, start)]
        size = self._pick(fitting) if fitting else ladder[-1]
        if self.verbose:
            io_utils.print_msg(
                f"AdaptiveBatchSize: probes at micro-batch {p} and {2 * p}: "
                f"{per_row / _MIB:.1f} MiB per row, {self._fixed / _MIB:.0f} MiB besides"
            )
        return size, self._predict(size, start)

    def _time_model(self, p: int, seconds: dict) -> None:
        """Slice time a + b * m from the probes' second runs (two slices each at
        p and 2p rows); a new shape's cost from the first run at 2p minus the
        second (the first run at p also optimizes the graph: not a shape cost)."""
        once, twice = seconds[p][1] / 2, seconds[2 * p][1] / 2
        b = max(0.0, (twice - once) / p)
        self._slice_seconds = (max(0.0, once - b * p), b)
        self._shape_seconds = max(0.0, seconds[2 * p][0] - seconds[2 * p][1])
        self._seen |= {p, 2 * p}

    def _step_seconds(self, size: int) -> float:
        a, b = self._slice_seconds
        return sum(a + b * m for m in _slices(self._rows, size))

    def _remaining_steps(self) -> int | None:
        steps, epochs = (self.params or {}).get("steps"), (self.params or {}).get("epochs")
        if not steps or not epochs:
            return None
        return max(0, steps * epochs - self._step)

    def _pick(self, fitting: list, say: bool = True) -> int:
        """Of the sizes predicted to fit (largest first): the largest, unless its
        new slice shapes' one-off cost (autotuning, measured by the probes) is
        more than it saves over the rest of the fit, against the largest size
        whose shapes have all run. Unknown fit length: the largest."""
        best = fitting[0]
        if self._slice_seconds is None or self._shape_seconds < _MIN_SHAPE_SECONDS:
            return best
        known = [r for r in fitting if _shapes(self._rows, r) <= self._seen]
        remaining = self._remaining_steps()
        if not known or known[0] == best or remaining is None:
            return best
        new_shapes = len(_shapes(self._rows, best) - self._seen)
        cost = self._shape_seconds * new_shapes
        gain = remaining * (self._step_seconds(known[0]) - self._step_seconds(best))
        if gain > cost:
            return best
        if say:
            text = (
                f"AdaptiveBatchSize: micro-batch {known[0]} rather than {best}: its "
                f"{new_shapes} new slice shape(s) would cost ~{cost:.1f} s of autotuning "
                f"and save ~{max(gain, 0.0):.1f} s over the remaining {remaining} steps"
            )
            _log.info(text)
            if self.verbose:
                io_utils.print_msg(text)
        return known[0]

    def _predict(self, size: int, start: int) -> int | None:
        if self._per_row is None:
            return None
        return int(start + self._fixed + self._per_row * size)

    def _shrink_share(self) -> float:
        return self.target_utilization + (1 - self.target_utilization) / 2

    def _shrink_line(self) -> float:
        """Peaks above this shrink the micro-batch: halfway between the target
        and the limit. A size chosen to peak under the target is kept through a
        peak a little over it (allocator noise): a new size costs cuDNN's
        autotuning of its slice shapes (41.8 s for one step of EfficientNetV2S
        on an H200, benchmarks/results/adaptive_efficientnet_h200.json)."""
        return self._shrink_share() * self._limit

    def _fits(self, size: int, start: int) -> bool:
        return self._predict(size, start) <= self.target_utilization * self._limit

    def _at_most(self, rows: int, size: int) -> int:
        """The largest size on the ladder that is at most `size` (at least the minimum)."""
        ladder = rungs(rows, self.min_micro_batch, self.max_micro_batch, self._least_slice)
        return next((r for r in ladder if r <= size), ladder[-1])

    def _change(self, kind: str, old, new: int, quiet: bool = False, **details) -> None:
        event = BatchEvent(self._step, self._epoch, kind, old, new, **details)
        self.events.append(event)
        if kind == "probe":
            text = f"probe at micro-batch {new}: peak {_mib(details.get('peak_bytes'))}"
        else:
            self.model._micro_batch_size = new
            self._measure_next = False
            slices = -(-self._rows // new) if self._rows else None
            predicted = details.get("predicted_bytes")
            text = {
                "start": f"micro-batch {new}"
                + (f" ({slices} slices)" if slices and slices > 1 else "")
                + (f", predicted peak {_mib(predicted)}" if predicted is not None else ""),
                "oom": f"out of memory at micro-batch {old} (raised after "
                f"{details.get('seconds_to_error', 0):.1f} s); running the same batch again at {new}",
                "grow": f"micro-batch {old} -> {new} (peak {_mib(details.get('peak_bytes'))})",
                "shrink": f"micro-batch {old} -> {new} (peak {_mib(details.get('peak_bytes'))} "
                f"over {self._shrink_share():.1%} of {_mib(self._limit)})",
            }[kind]
        text = f"AdaptiveBatchSize: step {self._step + 1} (epoch {self._epoch + 1}): {text}"
        _log.info(text)
        if self.verbose and not quiet:
            io_utils.print_msg(text)


def _mib(value) -> str:
    return "?" if value is None else f"{value / _MIB:.0f} MiB"
