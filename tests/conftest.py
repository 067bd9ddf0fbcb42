import contextlib
import gc
import os


def _worker() -> bool:
    """Whether this process is a pytest-xdist worker (`-n 2`: each a process of its own)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics (the memory tests) need TF's oneDNN allocator, on by default only on
# CPUs with AVX-512 VNNI/AMX: on for every CPU here (child processes inherit it).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import pytest  # noqa: E402


@contextlib.contextmanager
def _cpp_lines_silenced():
    """Descriptor 2 at /dev/null: TensorFlow's C++ start-up lines (absl's, oneDNN's, CUDA's
    where there is none), which pytest-xdist's controller printed after the summary. Not
    kvram._quiet.stderr_silenced: importing any part of kvram imports TensorFlow first."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)


with _cpp_lines_silenced():
    import keras  # noqa: E402
    import tensorflow as tf  # noqa: E402

    _GPUS = len(tf.config.list_physical_devices("GPU"))

# The tests check float32 transparency to 1e-5; TensorFloat-32 (on by default on
# Ampere and newer GPUs) rounds matrix products to ~1e-3 and would hide that.
tf.config.experimental.enable_tensor_float_32_execution(False)

# TensorFlow's and Keras's own objects (360k after import) are never garbage: out
# of the collector's sight (gc.freeze), clear_session()'s collection before each
# test scans only what tests made (0.17 s a test less; see _fresh_keras).
import kvram  # noqa: E402, F401

gc.collect()
gc.freeze()

# Two logical CPUs, for placement and tf.distribute tests ("CPU:0" stays the default).
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def _fresh_keras():
    """Every test starts with float32, a clear session and fixed seeds."""
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()  # collects the garbage of the tests before
    # What survived is held for good (TF's function and kernel caches): out of
    # the collector's sight, so the next collection scans only this test's objects.
    gc.freeze()
    keras.utils.set_random_seed(1234)
    yield
    keras.config.set_dtype_policy("float32")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and _GPUS < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multi_gpu" in item.keywords and _GPUS < 2:
            item.add_marker(pytest.mark.skip(reason="needs two GPUs"))
    # The longest first, so that neither worker ends the suite running one of them alone (GPT-2's
    # planned-transformer test, 55 s, last in the suite's order, ended a clean-clone run 13 s after
    # the other worker's last test).
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without `-n` on the command line, pytest-xdist's `-n auto` (`pytest_xdist_auto_num_workers`):
    where pytest-xdist is installed (`.[test]`), and not in an own_process child, which runs its
    one test in its own process, nor in a worker. Without pytest-xdist (the GPU machine's Python)
    the tests run in this process."""
    if (config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None) is None
            and not os.environ.get("KVRAM_TEST_ISOLATED") and not _worker()):
        config.option.numprocesses = "auto"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_auto_num_workers(config):
    """The workers `-n auto` starts: two where there are two cores or more, so that
    `pytest` uses CI's two cores from its first test (`pytest -m "not slow"`: 119-123 s against 197 s in
    one process on 2 cores); none (the tests in this process) on one core, or where TensorFlow sees
    a GPU, which each GPU test wants to itself. `-n 0` runs them in one process anywhere;
    PYTEST_XDIST_AUTO_NUM_WORKERS sets the number."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 0 if cores < 2 or _GPUS else 2


@pytest.fixture(scope="session")
def mirrored():
    """One MirroredStrategy over the two logical CPUs, shared by the tests.

    Several strategies with collective all-reduce in one process reuse collective
    instance keys and then clash ("Shape mismatch in the collective instance");
    reduction to one device uses no collective ops.
    """
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(cpus) < 2:
        pytest.skip("needs two logical CPUs")
    return tf.distribute.MirroredStrategy(
        cpus[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


def pytest_collection_finish(session):
    """Starts the children of the tests marked own_process ahead, beside the
    rest of the suite (tests/helpers.py, _Ahead), in the suite's order: a test
    the suite reaches while its child is still queued waits for the running
    child and then runs alone, so one early in the suite goes first (the plan
    families, last, are in their longest-first order)."""
    if os.environ.get("KVRAM_TEST_ISOLATED") or session.config.option.collectonly:
        return
    if _worker():  # each worker runs its children in its turn: two workers already fill two cores
        return
    from tests.helpers import AHEAD

    marked = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("own_process") is not None and not item.get_closest_marker("skip")
    ]
    if marked:
        AHEAD.start(marked)


def pytest_sessionfinish(session):
    from tests.helpers import AHEAD, child_cpu_line

    AHEAD.stop()
    if os.environ.get("KVRAM_TEST_ISOLATED"):
        import sys

        print(child_cpu_line(), file=sys.stderr, flush=True)


def pytest_terminal_summary(terminalreporter):
    """The own_process children's seconds (each ran beside the suite: its time
    is in no test's duration), longest first."""
    from tests.helpers import CHILD_TIMES

    if not CHILD_TIMES:
        return
    terminalreporter.section("children (own_process): wall and CPU seconds")
    for nodeid, (wall, cpu) in sorted(CHILD_TIMES.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"{wall:8.1f} s wall {'?' if cpu is None else f'{cpu:8.1f}'} s CPU  {nodeid}")
