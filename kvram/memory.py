"""Device memory: TensorFlow allocator statistics and NVML, on CPU and GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import threading
import time
from typing import Iterator

import tensorflow as tf

from kvram._state import mutable_state

__all__ = [
    "peak_bytes",
    "current_bytes",
    "reset_peak",
    "limit_bytes",
    "track",
    "Tracked",
    "MemoryMonitor",
    "is_out_of_memory",
]

_OOM_MARKERS = ("out of memory", "oom when allocating", "dst tensor is not initialized")


def is_out_of_memory(error: BaseException) -> bool:
    """True for TensorFlow's out-of-memory errors.

    Most surface as `ResourceExhaustedError`; a failed device copy under memory
    pressure surfaces as `InternalError: Dst tensor is not initialized`.
    """
    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    if isinstance(error, tf.errors.InternalError):
        message = str(error).lower()
        return any(marker in message for marker in _OOM_MARKERS)
    return False


_collections = threading.local()


def _note_full_collection(phase: str, info: dict) -> None:
    if phase == "start" and info.get("generation") == 2:
        _collections.ran = True  # thread-local: the collecting thread's


def collect_garbage(tries: int = 1000) -> None:
    """A full garbage collection made by this thread, before a measurement that
    counts on the garbage being gone (tensors of earlier steps, traces).
    `gc.collect()` does nothing and returns 0 while another thread's
    collection runs (CPython's gc_collect_impl), which happens when that
    collection's finalizers hand the GIL over; a clean-clone CI run once found
    a cycle uncollected after one. Asked again, 1 ms apart, up to `tries`
    times, until one of this thread's ran (seen by a `gc.callbacks` entry,
    there only meanwhile)."""
    gc.callbacks.append(_note_full_collection)
    try:
        for _ in range(tries):
            _collections.ran = False
            gc.collect()
            if _collections.ran:
                return
            time.sleep(0.001)
    finally:
        gc.callbacks.remove(_note_full_collection)


_DEVICE = re.compile(r"^(?:/?(?:device:)?)?(CPU|GPU)(?::(\d+))?$", re.IGNORECASE)


@contextlib.contextmanager
def state_kept(*holders) -> Iterator[None]:
    """Within, training-mode steps may run on the models (or layers, or
    optimizers) `holders`: their non-trainable variables (BatchNormalization's
    moving statistics, seed generators' states, an optimizer's iteration and
    slots) are put back, bit for bit, when it ends, error or not. Measuring
    steps do not train; without this they moved a pretrained model's
    BatchNormalization statistics (DenseNet121's inference outputs by 1.9e-2
    after `remat.plan`). Copies go to the host: the device's memory, which
    such steps measure, holds nothing more."""
    variables, seen = [], set()
    for holder in holders:
        if holder is None:
            continue
        found = holder.variables if hasattr(holder, "iterations") else mutable_state(holder)
        for variable in found:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    saved = [(variable, variable.numpy()) for variable in variables]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)


def _device_name(device: str | None) -> str:
    """'gpu', '/GPU:1', '/device:CPU:0' -> 'GPU:0', 'GPU:1', 'CPU:0'. None: GPU:0 if any."""
    if device is None:
        return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    if not isinstance(device, str):
        raise TypeError(
            f"`device` must be a string like 'GPU:0' or 'CPU:0'. Received: device={device!r}"
        )
    match = _DEVICE.match(device.strip())
    if not match:
        raise ValueError(
            "`device` must name a CPU or GPU, like 'GPU:0', '/GPU:1' or 'CPU:0'. "
            f"Received: device={device!r}"
        )
    return f"{match.group(1).upper()}:{match.group(2) or 0}"


def _statistics(call, device: str | None):
    """call(the device's TensorFlow name), its ValueError for a device without
    allocator statistics raised again saying which devices there are and how
    to get statistics for the CPU."""
    name = _device_name(device)
    try:
        return call(name)
    except ValueError as error:
        available = [d.name for d in tf.config.list_logical_devices()]
        fix = (
            " TensorFlow keeps CPU allocator statistics only with its oneDNN allocator: set "
            "TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow is imported (`import kvram` first does)."
            if name.startswith("CPU")
            else ""
        )
        raise ValueError(
            f"No memory statistics for device {name!r}: {error}. Devices: {available}.{fix} "
            f"Received: device={device!r}"
        ) from None


def _info(device: str | None) -> dict:
    return _statistics(tf.config.experimental.get_memory_info, device)


def peak_bytes(device: str | None = None) -> int:
    """Peak bytes held by TensorFlow's allocator on `device` since the last reset.

    Args:
        device: "GPU:0", "CPU:0", ...; default GPU:0 when a GPU is visible, else CPU:0.
    """
    return int(_info(device)["peak"])


def current_bytes(device: str | None = None) -> int:
    """Bytes held by TensorFlow's allocator on `device` now."""
    return int(_info(device)["current"])


def reset_peak(device: str | None = None) -> None:
    """Resets the peak of `device` to its current use, to measure the next block."""
    _statistics(tf.config.experimental.reset_memory_stats, device)


@dataclasses.dataclass
class Tracked:
    """What `track` measured for one block of code (bytes and seconds)."""

    name: str
    device: str
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0

    @property
    def delta_bytes(self) -> int:
        """Bytes still held after the block that were not held before it."""
        return self.end_bytes - self.start_bytes

    @property
    def peak_over_start_bytes(self) -> int:
        """How far above its starting use the block pushed the allocator."""
        return self.peak_bytes - self.start_bytes

    def __str__(self) -> str:
        mib = 2.0**20
        return (
            f"{self.name} on {self.device}: peak {self.peak_bytes / mib:.1f} MiB "
            f"(+{self.peak_over_start_bytes / mib:.1f} MiB), "
            f"delta {self.delta_bytes / mib:+.1f} MiB, {self.seconds:.3f} s"
        )


@contextlib.contextmanager
def track(name: str, device: str | None = None) -> Iterator[Tracked]:
    """Measures the allocated delta, the peak and the wall time of a block of code.

    The device's peak is reset on entry. Device work is asynchronous: the block
    should end with a value read back (`.numpy()`, a finished `fit`) so that its
    work is done when the clock stops.

    Example:
    ```python
    with kvram.memory.track("step") as t:
        model.train_on_batch(x, y)
    print(t.peak_bytes, t.delta_bytes, t.seconds)
    ```
    """
    record = Tracked(name=name, device=_device_name(device))
    reset_peak(record.device)
    record.start_bytes = current_bytes(record.device)
    start = time.perf_counter()
    try:
        yield record
    finally:
        record.seconds = time.perf_counter() - start
        record.end_bytes = current_bytes(record.device)
        record.peak_bytes = peak_bytes(record.device)


class MemoryMonitor:
    """Reads a device's memory from TensorFlow's allocator and, for GPUs, from NVML.

    TensorFlow's numbers count what its allocator hands out; NVML's count the whole
    device (other processes, the CUDA context, TF's reserved pool). NVML comes from
    `nvidia-ml-py`, imported on first use; without it, or without an NVIDIA driver,
    the NVML fields are None and `nvml_note` says why.

    Args:
        device: "GPU:0", "CPU:0", ...; default GPU:0 when a GPU is visible, else CPU:0.

    Example:
    ```python
    monitor = kvram.memory.MemoryMonitor("GPU:0")
    print(monitor.snapshot())   # {'device': 'GPU:0', 'tf_current_bytes': ..., 'nvml_free_bytes': ...}
    ```
    """

    def __init__(self, device: str | None = None):
        self.device = _device_name(device)
        self.nvml_note: str | None = None
        self._handle = None
        if self.device.startswith("GPU"):
            self._handle = self._nvml_handle(int(self.device.split(":")[1]))
        else:
            self.nvml_note = "NVML reports GPUs only; CPU figures come from TensorFlow"

    def _nvml_handle(self, index: int):
        try:
            import pynvml
        except ImportError:
            self.nvml_note = (
                "NVML unavailable: nvidia-ml-py is not installed "
                "(pip install nvidia-ml-py); device totals are not shown"
            )
            return None
        try:
            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetHandleByIndex(_physical_gpu_index(index))
        except pynvml.NVMLError as error:
            self.nvml_note = f"NVML unavailable: {error}; device totals are not shown"
            return None

    @property
    def nvml_available(self) -> bool:
        return self._handle is not None

    def snapshot(self) -> dict:
        """Current and peak TF allocator bytes, and NVML total/free/used bytes."""
        info = _info(self.device)
        record = {
            "device": self.device,
            "tf_current_bytes": int(info["current"]),
            "tf_peak_bytes": int(info["peak"]),
            "nvml_total_bytes": None,
            "nvml_free_bytes": None,
            "nvml_used_bytes": None,
        }
        if self._handle is not None:
            import pynvml

            mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
            record.update(
                nvml_total_bytes=int(mem.total),
                nvml_free_bytes=int(mem.free),
                nvml_used_bytes=int(mem.used),
            )
        return record


def _logical_gpus() -> list[tuple[int, int | None]]:
    """(physical index, memory limit in bytes or None) of each logical GPU, in order."""
    entries = []
    for index, physical in enumerate(tf.config.get_visible_devices("GPU")):
        configs = tf.config.get_logical_device_configuration(physical) or [None]
        for config in configs:
            limit = getattr(config, "memory_limit", None)
            entries.append((index, None if limit is None else int(limit) * 2**20))
    return entries


def _physical_gpu_index(logical_index: int) -> int:
    """NVML numbers physical GPUs; a logical GPU maps to the one it was split from."""
    entries = _logical_gpus()
    if not entries:
        return 0
    return entries[min(logical_index, len(entries) - 1)][0]


def limit_bytes(device: str | None = None) -> int | None:
    """The most memory TensorFlow may use on `device`, or None when unknown.

    A logical GPU's `memory_limit` when one was set
    (`tf.config.set_logical_device_configuration`), else the GPU's total memory
    from NVML. None for CPUs and when NVML is unavailable.
    """
    name = _device_name(device)
    if not name.startswith("GPU"):
        return None
    index = int(name.split(":")[1])
    entries = _logical_gpus()
    if index < len(entries) and entries[index][1] is not None:
        return entries[index][1]
    monitor = MemoryMonitor(name)
    return monitor.snapshot()["nvml_total_bytes"]


def _host_memory_pinned() -> bool:
    """Whether TensorFlow's runtime allocates host tensors pinned (`kvram.speed.pin_host_memory`:
    its `force_gpu_compatible` option), here where kvram.optimizers can read it too."""
    from tensorflow.python.eager import context

    config = context.context()._config
    return bool(config is not None and config.gpu_options.force_gpu_compatible)
