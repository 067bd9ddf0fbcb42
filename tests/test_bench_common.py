"""benchmarks/common.py's child runner, on made-up children (plain Python, no TensorFlow)."""

import sys

import pytest

from benchmarks.common import run_child, without_options


def test_run_child_reads_every_result_record_its_own_and_kvram_launchs_workers():
    script = ('import json\nprint("progress RESULT not a record")\nprint("RESULT " + json.dumps({"a": 1}))\n'
              'print("[worker 1] RESULT " + json.dumps({"worker": 1}))')
    records, error, _ = run_child([sys.executable, "-c", script])
    assert error is None and records == [{"a": 1}, {"worker": 1}]


def test_run_child_says_why_a_child_failed_or_printed_no_record():
    records, error, stderr = run_child([sys.executable, "-c", "import sys; sys.exit('went wrong')"])
    assert records == [] and "went wrong" in error and "went wrong" in stderr
    records, error, _ = run_child([sys.executable, "-c", "print('no record')"])
    assert records == [] and error == "no record\n"
    records, error, _ = run_child([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert records == [] and error == "timed out after 0.5 s"
    # a child cut short: the stage lines it had printed say how far it got
    script = "import sys, time; print('[    1.5 s] compiled', file=sys.stderr, flush=True); print('noise', " \
             "file=sys.stderr, flush=True); time.sleep(30)"
    records, error, stderr = run_child([sys.executable, "-c", script], timeout=3)
    assert records == [] and error == "timed out after 3 s\n[    1.5 s] compiled" and "noise" in stderr


def test_run_child_says_a_child_was_killed_by_a_signal():
    # SIGKILL, as the kernel's out-of-memory killer sends: the child's last line (a warning, say) is no reason
    script = ("import os, signal, sys; print('[    2.0 s] warm-up', file=sys.stderr); "
              "print('UserWarning: unrelated', file=sys.stderr, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    records, error, stderr = run_child([sys.executable, "-c", script])
    assert records == [] and error.startswith("killed by SIGKILL (exit -9) (on Linux, often the kernel's "
                                              "out-of-memory killer"), error
    assert "[    2.0 s] warm-up" in error and "UserWarning: unrelated" in stderr
    records, error, _ = run_child([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    assert records == [] and error.startswith("killed by SIGTERM (exit -15)\n"), error


def test_host_memory_watch_keeps_the_least_available_memory_it_read(monkeypatch):
    import builtins
    import io
    import threading

    from benchmarks.common import HostMemoryWatch

    readings = [8, 6, 3, 5]  # GiB available, one per read of /proc/meminfo; 9 after them
    read = threading.Semaphore(0)
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/meminfo":
            gib = readings.pop(0) if readings else 9
            read.release()
            return io.StringIO(f"MemTotal: 100 kB\nMemAvailable: {gib * 2**20} kB\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    with HostMemoryWatch(interval=0.001) as watch:
        for _ in range(5):  # the read on entering and four of the thread's
            read.acquire()
    assert watch.least_gib == 3
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc")))
    with HostMemoryWatch(interval=0.001) as unknown:
        pass
    assert unknown.least_gib is None


def test_without_options_drops_the_options_and_their_values():
    assert without_options(["--out", "x.json", "--steps", "3", "--only=a", "--only", "b"], ("--out", "--only")) == [
        "--steps", "3"]


def test_run_children_hands_the_results_so_far_to_each_after_every_child(tmp_path):
    from benchmarks.common import run_children

    script = tmp_path / "suite.py"
    script.write_text('import json, sys\nname = sys.argv[2]\nif name == "bad":\n    sys.exit("bad child")\n'
                      'print("RESULT " + json.dumps({"name": name, "n": int(sys.argv[3])}))\n')
    seen = []
    results = run_children(str(script), ["a", "bad", "b"], [7], lambda r: r["name"],
                           each=lambda so_far: seen.append(sorted(so_far)))
    assert seen == [["a"], ["a", "bad"], ["a", "b", "bad"]]
    assert results["a"]["n"] == 7 and results["b"]["name"] == "b" and "bad child" in results["bad"]["error"]


def test_capacity_combines_runs_of_one_shape_and_refuses_another_shape(tmp_path):
    import json


    from benchmarks.optimizers.capacity import combine

    def report(name, config, parameters, trained=True, hidden=2048):
        settings = {"gpu_memory_gib": 24.0, "sequence": 2048, "batch": 1, "hidden": hidden, "intermediate": 8192,
                    "heads": 32, "kv_heads": 8, "vocabulary": 32000, "steps": 8, "warmup": 3, "peak_tflops": 989.0,
                    "device": "GPU:0", "runs": f"{config}:1", "timeout": None}
        run = {"config": config, "depth": 1, "trained": trained, "parameters": parameters, "tokens_per_s": 1.0,
               "mfu": 0.1, "peak_gib": 20.0}
        path = tmp_path / name
        path.write_text(json.dumps({"date": "2026-12-06", "commit": name, "command": f"python x {name}",
                                    "gpu": "H200", "settings": settings, "runs": [run]}))
        return str(path)

    keras = report("a", "keras_adamw", 100)
    combined = combine([keras, report("b", "keras_adamw", 120, trained=False), report("c", "kvram_state", 450)])
    assert [r["commit"] for r in combined["runs"]] == ["a", "b", "c"]
    assert combined["largest_trained"]["keras_adamw"]["parameters"] == 100
    assert combined["kvram_parameters_over_keras"] == 4.5
    again = tmp_path / "combined"
    again.write_text(json.dumps(combined))
    assert [r["commit"] for r in combine([str(again), report("e", "keras_adamw", 130)])["runs"]] == ["a", "b", "c", "e"]
    with pytest.raises(SystemExit, match="differs .* in hidden"):
        combine([keras, report("d", "kvram_state", 450, hidden=1024)])


def test_timed_fit_says_on_stderr_when_warm_up_and_timed_steps_end(capfd):
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks.common import timed_fit

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensors((np.ones((2, 3), "float32"), np.ones((2, 1), "float32"))).repeat()
    held = tf.ones((2**20,)) * 2.0  # 4 MiB from TensorFlow's allocator, alive during the fit
    timed = timed_fit(model, data, steps=2, warmup=1, devices=["CPU:0"])
    lines = [line.split("] ", 1)[1] for line in capfd.readouterr().err.splitlines() if "] " in line]
    assert timed["steps"] == 2 and [line.split(":")[0] for line in lines] == ["warm-up", "warm-up done", "timed steps done"]
    assert timed["warmup_steps"] == 1 and timed["warmup_seconds"] > 0
    # what was in use before the first step, in the result and in the first stage line
    resident = timed["resident_gib"]["CPU:0"]
    assert resident is not None and resident * 2**30 >= held.shape[0] * 4  # what was allocated before it
    assert f"in use before it: CPU:0 {resident:.2f} GiB" in lines[0]


@pytest.mark.parametrize("per_execution", [1, 2])
def test_timed_fit_reads_the_last_executions_loss_beside_keras_mean(per_execution):
    import keras
    import numpy as np
    import tensorflow as tf

    from benchmarks.common import timed_fit

    # a learning rate of 0: the weights stay, so each batch's loss is known beforehand
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=per_execution)
    x = np.ones((6, 2, 3), "float32")
    y = np.repeat(np.arange(6, dtype="float32"), 2).reshape(6, 2, 1)  # batch i's loss: (3 - i)^2
    timed = timed_fit(model, tf.data.Dataset.from_tensor_slices((x, y)).repeat(), steps=4, warmup=2,
                      devices=["CPU:0"], last_loss=True)
    losses = [(3.0 - i) ** 2 for i in range(4)]  # each fit iterates the data from its start
    assert timed["loss"] == pytest.approx(np.mean(losses))  # Keras's: the mean over the timed steps
    assert timed["last_loss_steps"] == per_execution
    assert timed["last_loss"] == pytest.approx(np.mean(losses[-per_execution:]), abs=1e-5)
    assert "last_loss" not in timed_fit(model, tf.data.Dataset.from_tensor_slices((x, y)).repeat(), steps=2,
                                        warmup=2, devices=["CPU:0"])


def test_capacity_records_a_timed_out_run_as_such_with_how_far_it_got():
    from benchmarks.optimizers.capacity import _error_tail, _first_error_line

    error = "timed out after 190 s\n[   80.2 s] warm-up: 1 steps (compilation included)"
    assert _first_error_line(error) == "timed out after 190 s"
    assert _error_tail(error).endswith("warm-up: 1 steps (compilation included)")
