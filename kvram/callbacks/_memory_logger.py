"""`MemoryLogger`: each training step's memory to CSV and TensorBoard, and a
PNG timeline at the end."""

from __future__ import annotations

import csv
import dataclasses
import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from kvram import _checks, memory
from kvram.callbacks._adaptive import BatchEvent


_MIB = 2.0**20


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
        # the AdaptiveBatchSize of this fit(), if any, is the train function's
        controller = getattr(getattr(self.model, "train_function", None), "controller", None)
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
