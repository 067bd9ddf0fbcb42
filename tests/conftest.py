import contextlib
import fcntl
import gc
import os
import shutil
import tempfile

# Under pytest-xdist (`-n 2`) each worker is a process of its own; the folder of the
# lock files that keep a test marked alone from running beside another worker's test.
_LOCKS = "KVRAM_TEST_LOCKS"


def _worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


# A pytest-xdist worker's start-up (importing TensorFlow, collecting) counts as a test for the
# tests marked alone (`_alone_across_workers`): until its collection ends it holds the shared lock
# those wait on, so that the first of them, first in the suite, does not run beside it.
_STARTING = []
if _worker() and os.environ.get(_LOCKS):
    _STARTING.append(open(os.path.join(os.environ[_LOCKS], "held"), "a"))
    fcntl.flock(_STARTING[0], fcntl.LOCK_SH)

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
    # The tests marked alone go first: their children then run before the
    # own_process children start (pytest_collection_finish), where each would
    # wait for the running child to end (helpers._Ahead.quiet) while the suite
    # stood still: 930 s of a 3413-s clean-clone suite on 2 cores.
    # Then the longest, so that neither worker ends the suite running one of them alone (GPT-2's
    # planned-transformer test, 55 s, last in the suite's order, ended a clean-clone run 13 s after
    # the other worker's last test).
    items.sort(key=lambda item: (not _alone(item), item.get_closest_marker("longest") is None))  # stable


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


_MADE_LOCKS = []  # the folder this process made (pytest-xdist's controller), which it removes


def pytest_configure(config):
    if not _worker() and getattr(config.option, "numprocesses", None):
        # the workers start after this and inherit the environment
        os.environ[_LOCKS] = tempfile.mkdtemp(prefix="kvram-tests-")
        _MADE_LOCKS.append(os.environ[_LOCKS])


def pytest_unconfigure(config):
    # Only the process that made it: an own_process child of a worker inherits the variable
    # (and is no worker itself), and removed the folder under the workers once.
    for folder in _MADE_LOCKS:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(_LOCKS, None)
    _MADE_LOCKS.clear()


@pytest.fixture(autouse=True)
def _alone_across_workers(request):
    """Under pytest-xdist, a test marked alone runs while no other worker runs a
    test, and every other test holds the others' alone tests off: a shared lock
    on one file for each test, an exclusive one for an alone test. A second
    file is the gate an alone test holds while it waits for the shared locks
    to go, so that no worker starts a new test meanwhile (flock alone does not
    favour the waiting exclusive lock)."""
    folder = os.environ.get(_LOCKS) if _worker() else None
    if not folder:
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with contextlib.ExitStack() as stack:
        gate = stack.enter_context(open(os.path.join(folder, "gate"), "a"))
        held = stack.enter_context(open(os.path.join(folder, "held"), "a"))
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases their locks


def _alone(item) -> bool:
    return item.get_closest_marker("alone") is not None and item.get_closest_marker("skip") is None


_ALONE_LEFT = set()


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
    rest of the suite (tests/helpers.py, _Ahead), in the suite's order, once
    the tests marked alone (first in the suite) have run: a test the suite
    reaches while its child is still queued waits for the running child and
    then runs alone, so one early in the suite goes first (the plan families,
    last, are in their longest-first order)."""
    for started in _STARTING:  # this worker's start-up is over (see _STARTING)
        started.close()
    _STARTING.clear()
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
    _ALONE_LEFT.update(item.nodeid for item in session.items if _alone(item))
    if marked:
        AHEAD.start(marked, held=bool(_ALONE_LEFT))


def pytest_runtest_logfinish(nodeid, location):
    """After the last test marked alone, the own_process children start."""
    if nodeid in _ALONE_LEFT:
        _ALONE_LEFT.discard(nodeid)
        if not _ALONE_LEFT:
            from tests.helpers import AHEAD

            AHEAD.release()


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
