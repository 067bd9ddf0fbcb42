"""Keeps TensorFlow's C++ start-up lines out of the `kvram` command's output.

TensorFlow writes, on import and on its first device query, lines that read as errors to a
user who did nothing wrong ("oneDNN custom operations are on", "Could not find cuda drivers",
"failed call to cuInit: UNKNOWN ERROR (303)" on a machine without a GPU). Some are written
before absl's logging starts ("WARNING: All log messages before absl::InitializeLog() is
called are written to STDERR") and so ignore TF_CPP_MIN_LOG_LEVEL (absl writes every message
logged before its initialisation, whatever its level: https://github.com/abseil/abseil-cpp/pull/1957,
https://github.com/tensorflow/tensorflow/pull/102212). For the `kvram` command only (not a
program that imports kvram), child processes included (`kvram plan`'s), the import runs with
file descriptor 2 pointed at /dev/null and TF_CPP_MIN_LOG_LEVEL defaults to 3 (a level the user
set is kept: it still governs what TensorFlow logs later); `--verbose` anywhere on the command
line leaves both as they are.
"""

from __future__ import annotations

import contextlib
import os
import sys

VERBOSE_FLAG = "--verbose"
QUIETED = "KVRAM_QUIETED_TF"  # set to "1" where kvram set TF_CPP_MIN_LOG_LEVEL itself


def launched_as_command(argv: list[str] | None = None) -> bool:
    """True in the `kvram` console script and in `python -m kvram` (whose first argument reads
    "-m" while Python finds the module, which is when this package is imported)."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return False
    first = os.path.basename(argv[0])
    return first in ("kvram", "kvram.exe", "-m") or argv[0].endswith(os.path.join("kvram", "__main__.py"))


def wanted(argv: list[str] | None = None) -> bool:
    """Whether to quiet TensorFlow's start-up: the `kvram` command (its child processes
    too), without `--verbose`, before TensorFlow is imported."""
    argv = sys.argv if argv is None else argv
    return launched_as_command(argv) and VERBOSE_FLAG not in argv[1:] and "tensorflow" not in sys.modules


def _users_level(environ) -> bool:
    """Whether TF_CPP_MIN_LOG_LEVEL is the user's: a level a quieted `kvram` set (QUIETED)
    is not, and its child processes (kvram plan's) inherit it."""
    return "TF_CPP_MIN_LOG_LEVEL" in environ and environ.get(QUIETED) != "1"


@contextlib.contextmanager
def stderr_silenced():
    """Points file descriptor 2 (what C++ code writes to) at /dev/null for the block.

    Python's own sys.stderr is flushed first and writes to the same descriptor, so a Python
    error raised inside the block is printed after the descriptor is back, not lost."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real descriptor 2 (an embedding host)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow (and Keras) with its start-up lines silenced, when `wanted()`."""
    if not wanted():
        return
    if not _users_level(os.environ):
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        os.environ[QUIETED] = "1"
    with stderr_silenced():
        import keras  # noqa: F401
        import tensorflow as tf

        # The first device query loads the CUDA driver (or fails to: cuInit's error line).
        tf.config.list_physical_devices()
    global _NOTICE_OWED
    _NOTICE_OWED = True


# Whether this process imported TensorFlow quietly and has not yet spent the bfloat16 notice.
_NOTICE_OWED = False


def devices_set() -> None:
    """For a `kvram` command, once its devices are configured (`kvram plan --limit-gpu`'s and
    `kvram demo`'s logical GPU: TensorFlow's runtime, once started, keeps the devices it started
    with), before its first bfloat16 op: spends oneDNN's bfloat16 notice (`_spend_bfloat16_notice`)
    with descriptor 2 silenced. Only where the import was quieted; once per process.

    Not at the import: running an op starts the runtime, after which no logical GPU (no memory
    limit) can be made."""
    global _NOTICE_OWED
    if _NOTICE_OWED:
        _NOTICE_OWED = False
        import tensorflow as tf

        with stderr_silenced():
            _spend_bfloat16_notice(tf)


def _spend_bfloat16_notice(tf) -> None:
    """Runs a bfloat16 convolution and matmul, eagerly and in a graph, on the CPU.

    On a CPU without AVX-512, the first bfloat16 op oneDNN is asked to run logs, at ERROR
    level and once per process (absl::call_once), "oneDNN supports DT_BFLOAT16 only on
    platforms with AVX-512. Falling back to the default Eigen-based implementation"
    (tensorflow/tensorflow#40455): a level-2 TF_CPP_MIN_LOG_LEVEL shows it in the middle of
    `kvram plan`'s estimate, whose mixed-precision probes run bfloat16 on the CPU. Spending
    the once (`devices_set`), while descriptor 2 is silenced, keeps it out; nothing else is
    affected (the ops fall back to Eigen either way)."""
    with tf.device("CPU:0"):
        images = tf.ones([1, 2, 2, 1], tf.bfloat16)
        kernel = tf.ones([1, 1, 1, 1], tf.bfloat16)

        def ops(images, kernel):
            return tf.nn.conv2d(images, kernel, 1, "SAME"), tf.matmul(kernel[0, 0], kernel[0, 0])

        ops(images, kernel)
        tf.function(ops)(images, kernel)
