import time

import pytest
import tensorflow as tf

from kvram import memory


def test_peak_current_reset_on_cpu():
    memory.reset_peak("CPU:0")
    base = memory.current_bytes("CPU:0")
    with tf.device("CPU:0"):
        x = tf.ones((1024, 1024))  # 4 MiB
        y = x * 2.0
    assert memory.current_bytes("cpu") >= base
    assert memory.peak_bytes("/device:CPU:0") >= base + 4 * 2**20
    del x, y
    memory.reset_peak("CPU:0")
    assert memory.peak_bytes("CPU:0") == memory.current_bytes("CPU:0")


def test_track_records_peak_delta_time():
    with memory.track("alloc", "CPU:0") as t, tf.device("CPU:0"):
        keep = tf.ones((512, 1024)) + 1.0  # 2 MiB kept
        tmp = tf.ones((2048, 1024)) * 3.0  # 8 MiB temporary
        del tmp
        time.sleep(0.01)
    assert t.peak_over_start_bytes >= 8 * 2**20
    assert t.delta_bytes >= 2 * 2**20
    assert t.seconds >= 0.01
    assert "alloc on CPU:0" in str(t)
    del keep


@pytest.mark.parametrize("bad", ["TPU:0", "gpu0", ""])
def test_bad_device_name(bad):
    with pytest.raises(ValueError, match=f"must name a CPU or GPU.*Received: device={bad!r}"):
        memory.peak_bytes(bad)


def test_device_type_checked():
    with pytest.raises(TypeError, match="Received: device=0"):
        memory.peak_bytes(0)


def test_monitor_on_cpu_explains_nvml():
    monitor = memory.MemoryMonitor("CPU:0")
    snap = monitor.snapshot()
    assert snap["device"] == "CPU:0"
    assert snap["tf_current_bytes"] >= 0
    assert snap["nvml_total_bytes"] is None
    assert "GPUs only" in monitor.nvml_note


def test_monitor_without_gpu_degrades_with_note():
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible")
    monitor = memory.MemoryMonitor("GPU:0")
    assert not monitor.nvml_available
    assert monitor.nvml_note.startswith("NVML unavailable")
    with pytest.raises(ValueError, match="No memory statistics for device 'GPU:0'"):
        monitor.snapshot()


@pytest.mark.gpu
def test_monitor_on_gpu_reads_nvml():
    monitor = memory.MemoryMonitor("GPU:0")
    snap = monitor.snapshot()
    assert snap["nvml_total_bytes"] > snap["nvml_free_bytes"] > 0
    with memory.track("gpu", "GPU:0") as t:
        with tf.device("GPU:0"):
            x = tf.ones((4096, 4096))
            float(tf.reduce_sum(x @ x))
    assert t.peak_over_start_bytes >= 64 * 2**20


def _cpu_stats_in_child(code, onednn):
    """Runs `code` in a fresh Python with TF_ENABLE_ONEDNN_OPTS set as given
    (None: unset): its stdout and stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TF_ENABLE_ONEDNN_OPTS"}
    if onednn is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = onednn
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


@pytest.mark.slow
def test_import_kvram_first_gives_cpu_allocator_statistics():
    # TF's default CPU allocator keeps no statistics on CPUs without AVX-512
    # VNNI/AMX (oneDNN off by default there); `import kvram` before TF turns
    # TF's oneDNN allocator on, so CPU peaks can be read on any CPU.
    out = _cpu_stats_in_child(
        "import kvram, tensorflow as tf\n"
        "kvram.memory.reset_peak('CPU:0')\n"
        "x = tf.ones((1024, 1024))\n"
        "print('PEAK', kvram.memory.peak_bytes('CPU:0'))\n",
        onednn=None,
    )
    peaks = [int(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK ")]
    assert peaks and peaks[0] >= 4 * 2**20, out[-3000:]


@pytest.mark.slow
def test_cpu_without_statistics_says_how_to_get_them():
    out = _cpu_stats_in_child(
        "import tensorflow as tf\n"
        "from kvram import memory\n"
        "for read in (memory.peak_bytes, memory.current_bytes, memory.reset_peak):\n"
        "    try:\n"
        "        read('CPU:0')\n"
        "        print('HAS STATS')\n"
        "    except ValueError as error:\n"
        "        print('ERROR', error)\n",
        onednn="0",
    )
    assert out.count("ERROR No memory statistics for device 'CPU:0'") == 3, out[-3000:]
    assert out.count("TF_ENABLE_ONEDNN_OPTS=1") == 3, out[-3000:]


def test_collect_garbage_collects_while_another_threads_collection_runs():
    import gc
    import threading
    import weakref

    entered, release = threading.Event(), threading.Event()

    class Slow:
        def __del__(self):
            entered.set()
            release.wait(10)  # hands the GIL over inside the other thread's collection

    class Node:
        pass

    def collect_slow_garbage():
        slow = Slow()
        slow.self = slow
        del slow
        gc.collect()

    other = threading.Thread(target=collect_slow_garbage)
    other.start()
    try:
        assert entered.wait(10)
        node = Node()
        node.self = node
        ref = weakref.ref(node)
        del node
        gc.collect()  # does nothing while the other collection runs
        assert ref() is not None
        threading.Timer(0.2, release.set).start()
        memory.collect_garbage()
        assert ref() is None and release.is_set()
        assert memory._note_full_collection not in gc.callbacks
    finally:
        release.set()
        other.join()
