"""Callbacks for `fit()`: memory-aware micro-batching that survives out-of-memory
errors, a search for the largest micro-batch, and a per-step memory log."""

from __future__ import annotations

import csv
import dataclasses
import gc
import logging
import math
import os
import time
import warnings
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.utils import io_utils

from kvram import _batch_statistics, _checks, memory
from kvram._train_function import TrainFunction, is_out_of_memory, unique

__all__ = ["AdaptiveBatchSize", "MemoryLogger", "find_max_batch_size", "BatchSizeSearch"]

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
        from kvram.model import Model

        if not isinstance(self.model, Model):
            raise TypeError(
                "AdaptiveBatchSize needs a kvram.Model, whose training step can slice "
                f"batches and run one again. Received: a {type(self.model).__name__}"
            )
        self._limit = self.memory_limit or memory.limit_bytes(self.device)
        self._measure_next = False  # the first step also traces and compiles
        self._least_slice = _batch_statistics.least_rows(self.model)
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


class BatchSizeSearch(NamedTuple):
    """What `find_max_batch_size` found: the size and every probe, in order."""

    size: int
    probes: list


def find_max_batch_size(
    model,
    sample_batch,
    low: int = 1,
    high: int | None = None,
    margin: float = 0.1,
    verbose: int = 1,
) -> BatchSizeSearch:
    """The largest micro-batch a compiled `kvram.Model` trains with, and the probes.

    Each probe runs one full training step (forward, backward, update; with the
    gradient sum of a second slice) on `sample_batch`'s rows repeated to the probed
    size (one compiled step serves every size), catches an out-of-memory error if one comes, and puts every weight,
    optimizer and metric variable back as it was: the model is unchanged
    afterwards. Sizes grow by doubling from `low` until one fails (when `high`
    is given and at least 8x `low`, `high` is probed first), then the search
    bisects (in log space) between the largest size that trained and the
    smallest that failed, until the returned size is within `margin` of the
    true maximum.

    Args:
        model: a compiled `kvram.Model`.
        sample_batch: `(x, y)` or `(x, y, sample_weight)` with at least one row.
        low: int >= 1, the smallest size; an error is raised if it does not fit.
        high: None or int >= low, the largest size worth trying.
        margin: float in (0, 1), relative precision of the answer.
        verbose: 0 or 1, print each probe.

    Returns:
        `BatchSizeSearch(size, probes)`; each probe is a dict with `size`,
        `fits`, `seconds` and `error` (the OOM message's first line, or None).

    Raises:
        RuntimeError: when `low` does not fit.
    """
    from kvram.model import Model

    if not isinstance(model, Model):
        raise TypeError(
            f"find_max_batch_size needs a kvram.Model. Received: a {type(model).__name__}"
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError("Compile the model before find_max_batch_size(model, ...).")
    low = _checks.positive_int("low", low)
    high = _checks.positive_int("high", high, allow_none=True)
    if high is not None and high < low:
        raise ValueError(f"`high` must be >= `low`. Received: low={low}, high={high}")
    margin = _checks.positive_float("margin", margin)
    if margin >= 1:
        raise ValueError(f"`margin` must be in (0, 1). Received: margin={margin!r}")
    sample_batch = tuple(sample_batch) if isinstance(sample_batch, (list, tuple)) else (sample_batch,)
    rows = int(np.shape(next(t for t in tree.flatten(sample_batch) if t is not None))[0])
    if rows < 1:
        raise ValueError("`sample_batch` must hold at least one row. Received: 0 rows")

    probes: list[dict] = []
    previous_size, previous_function = model._micro_batch_size, model.train_function
    function = TrainFunction(model)
    function.build(tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), sample_batch
    ))
    # One compiled gradient pass for every probed size (its size is an argument).
    gradients = function.gradients_function(tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), sample_batch
    ))
    apply = function.apply_function()
    saved = [(v, v.numpy()) for v in _all_variables(model)]

    def probe(size: int) -> bool:
        index = np.arange(size + 1) % rows  # size rows, plus a one-row second slice
        batch = tree.map_structure(
            lambda t: None if t is None else tf.gather(tf.convert_to_tensor(t), index),
            sample_batch,
        )
        model._micro_batch_size = size
        started = time.perf_counter()
        error_text = None
        try:
            logs = apply(gradients(batch, tf.constant(size, tf.int32)))
            tree.map_structure(lambda t: np.asarray(t), logs)  # wait for the device
            fits = True
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
            if not is_out_of_memory(error):
                raise
            fits, error_text = False, str(error).strip().splitlines()[0][:200]
        finally:
            for variable, value in saved:
                variable.assign(value)
            del batch
            gc.collect()
        probes.append(
            {
                "size": size,
                "fits": fits,
                "seconds": time.perf_counter() - started,
                "error": error_text,
            }
        )
        if verbose:
            io_utils.print_msg(
                f"find_max_batch_size: {size} {'fits' if fits else 'out of memory'}"
            )
        return fits

    try:
        if not probe(low):
            raise RuntimeError(
                f"find_max_batch_size: not even low={low} rows fit in memory "
                f"({probes[-1]['error']})."
            )
        good, bad = low, None
        if high is not None:
            bad = high + 1
            if high >= 8 * low and high > low:
                if probe(high):
                    return BatchSizeSearch(high, probes)
                bad = high
        else:
            while True:  # growth
                size = 2 * good
                if probe(size):
                    good = size
                else:
                    bad = size
                    break
        # Bisection in log space, until any size above `good` that might fit is
        # within `margin` of it.
        while bad - good > 1 and (bad - 1) * (1 - margin) > good:
            size = int(round(math.sqrt(good * bad)))
            size = min(max(size, good + 1), bad - 1)
            if probe(size):
                good = size
            else:
                bad = size
        return BatchSizeSearch(good, probes)
    finally:
        model._micro_batch_size = previous_size
        model.train_function = previous_function


def _all_variables(model) -> list:
    variables = list(model.variables) + list(model.metrics_variables) + model._kvram_counters()
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    return unique(variables)


class MemoryLogger(keras.callbacks.Callback):
    """Writes each training step's memory to CSV and TensorBoard, and a PNG timeline.

    Per step: TF allocator current and peak bytes on `device` (peak reset at the
    start of each step), the micro-batch size, the loss, the loss scale and the
    skipped-step count. Files in `logdir`:

    - `memory.csv`: one row per step (written as it goes, so a crash keeps it).
    - TensorBoard event files (`tensorboard --logdir logdir`): scalars under
      `memory/` and `batch/`.
    - `events.csv`: AdaptiveBatchSize's changes (OOM recoveries, grow, shrink).
    - `memory.png` at the end of training: current and peak MiB per step, OOM
      recoveries as red lines, micro-batch changes as grey lines, and the
      micro-batch size on a second axis (matplotlib, imported then; without it
      a warning says the PNG was not written).

    Args:
        logdir: directory to write to (created if missing).
        device: None ("GPU:0" when a GPU is visible, else "CPU:0") or a device name.
        plot: bool, write `memory.png` at the end.
    """

    COLUMNS = (
        "step",
        "epoch",
        "batch",
        "seconds",
        "current_bytes",
        "peak_bytes",
        "micro_batch_size",
        "loss",
        "loss_scale",
        "skipped_steps",
    )

    def __init__(self, logdir, device: str | None = None, plot: bool = True):
        super().__init__()
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(f"`logdir` must be a path. Received: logdir={logdir!r}")
        self.logdir = os.fspath(logdir)
        _check_writable_directory(self.logdir)
        self.device = memory._device_name(device)
        self.plot = _checks.boolean("plot", plot)
        self._write_error: OSError | None = None
        self.rows: list[dict] = []
        self._file = None
        self._writer = None
        self._writer_tf = None
        self._step = 0
        self._epoch = 0
        self._started = 0.0

    def on_train_begin(self, logs=None):
        _check_writable_directory(self.logdir)  # before any step: nothing is lost
        try:
            os.makedirs(self.logdir, exist_ok=True)
            self._file = open(os.path.join(self.logdir, "memory.csv"), "w", newline="")
        except OSError as error:
            raise OSError(
                f"MemoryLogger cannot write its logs to {self.logdir} ({error}). "
                f"Received: logdir={self.logdir!r}"
            ) from error
        self.rows = []
        self._write_error = None
        self._writer = csv.DictWriter(self._file, fieldnames=self.COLUMNS)
        self._writer.writeheader()
        self._writer_tf = tf.summary.create_file_writer(self.logdir)
        self._started = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        memory.reset_peak(self.device)

    def on_train_batch_end(self, batch, logs=None):
        logs = {k: _scalar(v) for k, v in (logs or {}).items()}  # also waits for the step
        row = {
            "step": self._step,
            "epoch": self._epoch,
            "batch": batch,
            "seconds": round(time.perf_counter() - self._started, 6),
            "current_bytes": memory.current_bytes(self.device),
            "peak_bytes": memory.peak_bytes(self.device),
            "micro_batch_size": getattr(self.model, "micro_batch_size", None),
            "loss": logs.get("loss"),
            "loss_scale": logs.get("loss_scale"),
            "skipped_steps": logs.get("skipped_steps"),
        }
        self.rows.append(row)
        self._step += 1
        if self._write_error is not None:
            return
        try:
            self._writer.writerow(row)
            self._file.flush()
            with self._writer_tf.as_default(step=row["step"]):
                _scalar_summary("memory/current_mib", row["current_bytes"] / _MIB)
                _scalar_summary("memory/peak_mib", row["peak_bytes"] / _MIB)
                for name in ("micro_batch_size", "loss", "loss_scale", "skipped_steps"):
                    if row[name] is not None:
                        _scalar_summary(f"batch/{name}", float(row[name]))
        except OSError as error:  # a full disk must not stop training
            self._write_error = error
            warnings.warn(
                f"MemoryLogger: writing to {self.logdir} failed at step {row['step']} "
                f"({error}); training goes on, and the rows are kept in memory "
                "(MemoryLogger.rows) but no longer written.",
                stacklevel=2,
            )

    def on_train_end(self, logs=None):
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._writer_tf is not None:
            try:
                self._writer_tf.flush()
                self._writer_tf.close()
            except (OSError, tf.errors.OpError):
                pass
        if self._write_error is not None:
            return  # warned already; the rows are in self.rows
        events = self._events()
        with open(os.path.join(self.logdir, "events.csv"), "w", newline="") as handle:
            fields = [f.name for f in dataclasses.fields(BatchEvent)]
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            for event in events:
                writer.writerow(event.as_dict())
        if self.plot:
            try:
                self.plot_timeline(os.path.join(self.logdir, "memory.png"), events)
            except ImportError:
                warnings.warn(
                    "MemoryLogger: matplotlib is not installed, so memory.png was not "
                    "written (pip install matplotlib, or kvram[plot]); the CSV and "
                    "TensorBoard logs are complete.",
                    stacklevel=2,
                )

    def _events(self) -> list:
        controller = getattr(self.model, "_batch_controller", None)
        return list(getattr(controller, "events", []))

    def plot_timeline(self, path: str, events=()) -> str:
        """Writes the memory timeline of the rows logged so far to `path` (PNG)."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        figure, axis = plt.subplots(figsize=(10, 4.5))
        axis.plot(steps, [r["current_bytes"] / _MIB for r in self.rows], label="current")
        axis.plot(steps, [r["peak_bytes"] / _MIB for r in self.rows], label="peak in step")
        axis.set_xlabel("training step")
        axis.set_ylabel(f"{self.device} MiB (TF allocator)")
        for event in events:
            if event.kind == "oom":
                axis.axvline(event.step, color="red", linestyle="-", alpha=0.6)
            elif event.kind in ("grow", "shrink"):
                axis.axvline(event.step, color="grey", linestyle="--", alpha=0.6)
        sizes = [r["micro_batch_size"] for r in self.rows]
        if any(s is not None for s in sizes):
            twin = axis.twinx()
            twin.step(steps, [np.nan if s is None else s for s in sizes], where="post",
                      color="black", alpha=0.5, label="micro-batch")
            twin.set_ylabel("micro-batch rows")
        ooms = sum(e.kind == "oom" for e in events)
        changes = sum(e.kind in ("grow", "shrink") for e in events)
        axis.set_title(f"memory per step ({ooms} OOM recoveries in red, {changes} changes in grey)")
        axis.legend(loc="upper left")
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path


def _scalar_summary(tag: str, value: float) -> None:
    """A TensorBoard scalar, written by TF's core summary op.

    `tf.summary.scalar` needs the `tensorboard` package installed in the training
    environment; this writes the same record (scalars plugin metadata) without it.
    """
    from tensorflow.core.framework import summary_pb2

    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    tf.summary.write(tag, tf.constant(value, tf.float32), metadata=metadata)


def _check_writable_directory(path: str) -> None:
    """Raises if `path` cannot be a directory this process writes to."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing == os.path.abspath(path) and not os.path.isdir(existing):
        problem = "it is a file, not a directory"
    elif not os.path.isdir(existing):
        problem = f"{existing} is a file, so no directory can be made under it"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable by this process"
    else:
        return
    raise ValueError(
        f"MemoryLogger cannot write its logs to {path}: {problem}. Received: logdir={path!r}"
    )


def _scalar(value):
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - logs may hold anything a user's metric returns
        return None
    return float(array) if array.size == 1 else None
