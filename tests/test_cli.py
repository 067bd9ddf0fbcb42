import re
import json
import os
import sys

import pytest

from kvram import cli
from tests.helpers import in_own_process


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensorflow"] and report["keras"]
    assert "/device:CPU:0" in report["devices"]


def test_info_text(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tensorflow" in out and "devices" in out


@pytest.mark.slow
def test_demo_small_runs_and_prints_table(capsys, tmp_path):
    path = tmp_path / "demo.json"
    code = cli.main(["demo", "--device", "CPU:0", "--epochs", "1", "--samples", "1024",
                     "--batch-size", "512", "--blocks", "4", "--width", "128", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "peak memory (MiB)" in out and "final loss" in out
    # one labelled progress bar per run, the same precision on both sides, and what kvram bought
    assert "plain Keras (float32):" in out and "kvram, every block checkpointed (float32):" in out
    assert "kvram trained the same model" in out and "x the peak memory of plain Keras" in out
    result = json.loads(path.read_text())
    # Same model, same data, same seeds, float32 on CPU: the same function is trained.
    assert abs(result["kvram"]["final_loss"] - result["plain"]["final_loss"]) < 1e-3
    assert result["kvram"]["peak_mib"] < result["plain"]["peak_mib"]


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py): ~23 s of training
def test_demo_loss_falls_from_the_first_step_on_a_deep_wide_model(tmp_path, request):
    """12 blocks of width 512 (the GPU demo's depth): with Keras's default initialisation under
    Adam(1e-3) the loss rose from 3.07 to 7.83 in four steps before it fell (as on an H200 at width
    1024, batch 16384: 3.13 to 11.32); kvram demo's model and optimizer must train smoothly."""
    if in_own_process(request):
        return
    path = tmp_path / "demo.json"
    # 1024 samples: 4 steps an epoch (the rise took four steps), 23 s instead of 33 at 2048
    assert cli.main(["demo", "--device", "CPU:0", "--epochs", "2", "--samples", "1024", "--batch-size", "256",
                     "--width", "512", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    for run in ("plain", "kvram"):
        losses = result[run]["losses"]  # each epoch's running mean, step by step
        assert len(losses) == 8 and max(losses) <= losses[0] and losses[-1] < losses[0] - 0.1, losses


def test_demo_limits_the_gpu_before_anything_runs_and_refuses_to_run_unlimited(monkeypatch):
    """On a GPU the demo's point is its limit: set first, then the command's devices_set() (which runs
    ops); a limit TensorFlow refuses (its runtime had started) is an error, not an unlimited run."""
    import importlib

    _demo = importlib.import_module("kvram.cli._demo")
    calls = []

    class Stop(Exception):
        pass

    def devices_set():
        calls.append("devices_set")
        raise Stop

    monkeypatch.setattr(_demo._quiet, "devices_set", devices_set)
    monkeypatch.setattr(_demo, "limit_gpu", lambda size: calls.append(("limit_gpu", size)) or True)
    with pytest.raises(Stop):
        _demo.run_demo("GPU:0", print_fn=lambda *_: None)
    assert calls == [("limit_gpu", 4 * 2**30), "devices_set"]

    def refused(size):
        raise RuntimeError("Virtual devices cannot be modified after being initialized")

    monkeypatch.setattr(_demo, "limit_gpu", refused)
    with pytest.raises(RuntimeError, match=r"could not limit the GPU to 2\.0 GiB: TensorFlow's runtime had started"):
        _demo.run_demo("GPU:0", gpu_memory=2 * 2**30, print_fn=lambda *_: None)


@pytest.mark.slow
def test_the_commands_import_leaves_the_devices_to_configure(tmp_path):
    """`import kvram` in a `kvram` command starts no TensorFlow runtime: kvram demo and kvram plan
    --limit-gpu then make their logical GPU (here: two logical CPUs, the same call). Its quiet import
    once ran a bfloat16 op, and on an H200 the demo's plain Keras trained in 7392 MiB under "4 GiB"."""
    import subprocess

    script = (
        "import sys\n"
        "sys.argv = ['kvram', 'demo']\n"
        "import kvram, tensorflow as tf\n"
        "from tensorflow.python.eager import context\n"
        "assert not context.context()._initialized, 'the runtime started at import'\n"
        "cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)\n"
        "print(len(tf.config.list_logical_devices('CPU')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["2"], done.stdout + done.stderr[-3000:]


def test_demo_summary_says_what_kvram_bought_when_plain_keras_runs_out():
    import importlib

    _demo = importlib.import_module("kvram.cli._demo")  # kvram.cli's own _demo is the command
    result = {"device": "GPU:0", "gpu_memory_limit_bytes": 4 * 2**30, "config": {"batch_size": 16384},
              "plain": {"policy": "mixed_bfloat16", "out_of_memory": True},
              "kvram": {"policy": "mixed_bfloat16", "out_of_memory": False, "peak_mib": 2345.6,
                        "step_ms": 80.0, "final_loss": 1.5}}
    result["summary"] = _demo.summary(result)
    assert result["summary"] == ("On a 4.0 GiB GPU, plain Keras ran out of memory at batch 16384; kvram "
                                 "trained it in 2346 MiB at the same precision (mixed_bfloat16), recomputing "
                                 "every block.")
    table = _demo.format_table(result)
    assert re.search(r"peak memory \(MiB\) +out of memory +2345.6", table), table


def test_demo_summary_claims_no_saving_where_kvram_peaked_no_lower():
    import importlib

    _demo = importlib.import_module("kvram.cli._demo")
    result = {"device": "CPU:0", "config": {"batch_size": 512}, "memory_ratio": 1.09, "time_ratio": 1.2,
              "plain": {"policy": "float32", "out_of_memory": False, "peak_mib": 400.0, "final_loss": 2.3},
              "kvram": {"policy": "float32", "out_of_memory": False, "peak_mib": 436.0, "final_loss": 2.3}}
    summary = _demo.summary(result)
    assert "in 1.09x the peak memory of plain Keras (436.0 vs 400.0 MiB)" in summary, summary
    assert "lowered no peak at this shape" in summary and "only kvram trains" not in summary, summary
    result["memory_ratio"], result["kvram"]["peak_mib"] = 0.5, 200.0
    assert "only kvram trains" in _demo.summary(result)


def test_demo_rejects_bad_numbers(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["demo", "--epochs", "0"])
    assert "must be >= 1" in capsys.readouterr().err


# kvram shards write: OUT is the last path, and only a kvram shard directory is replaced


def _run(argv, capsys):
    """(exit code, stderr) of `kvram ARGV`, as the console script ends: a
    SystemExit with a message prints it to stderr and exits with 1."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exit:
        code = exit.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    return code, capsys.readouterr().err


def _npy(path, rows=6):
    import numpy as np

    np.save(path, np.arange(rows * 2, dtype="float32").reshape(rows, 2))
    return path.read_bytes()


def test_a_forgotten_out_does_not_destroy_a_source(tmp_path, capsys):
    x, y = tmp_path / "x.npy", tmp_path / "y.npy"
    saved = {x: _npy(x), y: _npy(y)}
    code, err = _run(["shards", "write", str(x), str(y), "--overwrite"], capsys)
    assert code == 1
    assert err == (
        f"kvram shards write: OUT {y} is named like a source: the last path is the output directory, "
        f"so nothing was written. Understood: SRC {x}, OUT {y}. Give OUT last: kvram shards write "
        "SRC.npz OUT/\n"
    )
    assert {p: p.read_bytes() for p in saved} == saved and sorted(os.listdir(tmp_path)) == ["x.npy", "y.npy"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_that_is_a_source_or_a_file_is_refused(tmp_path, capsys, overwrite):
    data = tmp_path / "data.bin"
    data.write_bytes(b"user data")
    x = tmp_path / "x.npy"
    saved = _npy(x)
    code, err = _run(["shards", "write", str(x), str(data), *overwrite], capsys)
    assert code == 1
    assert err == (
        f"kvram shards write: OUT {data} is an existing file, not a directory; nothing was written. "
        f"Understood: SRC {x}, OUT {data}\n"
    )
    link = tmp_path / "x-link"
    os.symlink(x, link)
    code, err = _run(["shards", "write", str(x), str(link), *overwrite], capsys)
    assert code == 1
    assert err == (
        f"kvram shards write: OUT {link} is also a source; nothing was written. Understood: SRC {x}, "
        f"OUT {link}\n"
    )
    assert data.read_bytes() == b"user data" and x.read_bytes() == saved


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_that_is_a_users_directory_is_refused(tmp_path, capsys, overwrite):
    x = tmp_path / "x.npy"
    _npy(x)
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "thesis.tex").write_text("\\chapter{One}")
    code, err = _run(["shards", "write", str(x), str(user), *overwrite], capsys)
    assert code == 1
    assert err == (
        f"kvram shards write: {user} exists and is not a kvram shard directory: it holds thesis.tex and "
        "no kvram index.json. kvram replaces only shard directories it wrote, with or without "
        "--overwrite; nothing was written. Choose a new directory for the shards. "
        f"Received: directory={str(user)!r}\n"
    )
    assert os.listdir(user) == ["thesis.tex"] and (user / "thesis.tex").read_text() == "\\chapter{One}"


def test_overwrite_replaces_a_shard_directory(tmp_path, capsys):
    from kvram.data import ShardedDataset

    x = tmp_path / "x.npy"
    _npy(x, rows=6)
    out = tmp_path / "out"
    assert _run(["shards", "write", str(x), str(out)], capsys)[0] == 0
    code, err = _run(["shards", "write", str(x), str(out)], capsys)
    assert code == 1 and err == (
        f"kvram shards write: {out} exists (a kvram shard directory); pass --overwrite to replace it. "
        f"Received: directory={str(out)!r}\n"
    )
    _npy(x, rows=3)
    assert _run(["shards", "write", str(x), str(out), "--overwrite"], capsys)[0] == 0
    assert len(ShardedDataset(out)) == 3


def test_write_images_names_its_flag_to_replace_shards(tmp_path, capsys):
    x = tmp_path / "x.npy"
    _npy(x)
    out = tmp_path / "out"
    assert _run(["shards", "write", str(x), str(out)], capsys)[0] == 0
    code, err = _run(["shards", "write-images", str(tmp_path), str(out)], capsys)
    assert code == 1 and err == (
        f"kvram shards write-images: {out} exists (a kvram shard directory); pass --overwrite to replace it. "
        f"Received: directory={str(out)!r}\n"
    )


def test_bad_sources_end_in_one_line(tmp_path, capsys):
    import numpy as np

    out = tmp_path / "out"
    code, err = _run(["shards", "write", str(tmp_path / "nosuch.npz"), str(out)], capsys)
    assert code == 1 and err == f"kvram shards write: {tmp_path / 'nosuch.npz'}: no such file\n"
    np.savez(tmp_path / "empty.npz")
    code, err = _run(["shards", "write", str(tmp_path / "empty.npz"), str(out)], capsys)
    assert code == 1 and err == f"kvram shards write: {tmp_path / 'empty.npz'} holds no arrays: nothing to write\n"
    (tmp_path / "text.npz").write_text("not a zip")
    code, err = _run(["shards", "write", str(tmp_path / "text.npz"), str(out)], capsys)
    assert code == 1 and err == (
        f"kvram shards write: {tmp_path / 'text.npz'}: not a .npz file (expected a zip of .npy arrays, as "
        "numpy.savez writes)\n")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    code, err = _run(["shards", "write", str(tmp_path / "objects.npy"), str(out)], capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"kvram shards write: {tmp_path / 'objects.npy'}: not an array file numpy can read "
                          "without pickle (ValueError: ")
    assert not out.exists()


def test_a_user_error_from_any_command_is_one_line(tmp_path, capsys, monkeypatch):
    import numpy as np

    bad = tmp_path / "ragged.npz"
    np.savez(bad, x=np.zeros((4, 2)), y=np.zeros(3))
    code, err = _run(["shards", "write", str(bad), str(tmp_path / "out")], capsys)
    assert code == 1 and err == (
        "kvram shards write: All fields must hold the same number of samples. Received: {'x': 4, 'y': 3}\n")
    monkeypatch.setenv("KVRAM_TRACEBACK", "1")
    with pytest.raises(ValueError, match="same number of samples"):
        cli.main(["shards", "write", str(bad), str(tmp_path / "out")])


def test_launch_of_a_command_that_does_not_exist_is_one_line(capsys):
    code, err = _run(["launch", "--workers", "2", "--gpus", "none", "--", "nosuchcmd", "--flag"], capsys)
    assert code == 1 and err == (
        "kvram launch: nosuchcmd: no such command (not on PATH, nor an executable file); no worker was "
        "started. Received: command=['nosuchcmd', '--flag']\n"
    )


# No TensorFlow start-up lines in the command's output (kvram/_quiet.py)


def _command(*argv, cwd):
    """stderr and stdout of the `kvram` console script run as a user runs it: TF_CPP_MIN_LOG_LEVEL unset."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    script = os.path.join(os.path.dirname(sys.executable), "kvram")
    done = subprocess.run([script, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_the_command_prints_no_tensorflow_log_lines_unless_verbose(tmp_path, request):
    if in_own_process(request):
        return
    code, out, err = _command("info", cwd=tmp_path)
    assert code == 0 and "tensorflow" in out
    assert err == ""  # without the fix: absl's notice, oneDNN's and cudart's lines, cuInit's error
    code, out, err = _command("--verbose", "info", cwd=tmp_path)
    assert code == 0 and "oneDNN custom operations" in err  # TF_ENABLE_ONEDNN_OPTS=1 (kvram/__init__.py)
    # A user's error is still its one line, with the descriptor back in place.
    code, out, err = _command("shards", "inspect", str(tmp_path / "missing"), cwd=tmp_path)
    assert code == 1 and err == f"kvram shards inspect: {tmp_path / 'missing'}: no such shard directory\n"


_BFLOAT16_FIT = """
import sys
sys.argv = ["kvram", "plan"]  # as the command's processes (kvram plan's child among them) import kvram
import kvram, keras, numpy as np
kvram._quiet.devices_set()  # as kvram plan and kvram demo do once their devices are set
keras.mixed_precision.set_global_policy("mixed_bfloat16")
model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.Conv2D(4, 3), keras.layers.Dense(2)])
model.compile("sgd", "mse")
model.fit(np.ones((4, 6, 6, 3)), np.ones((4, 4, 4, 2)), verbose=0)
print("fitted")
"""


@pytest.mark.slow
def test_the_commands_bfloat16_steps_print_no_onednn_error_line(tmp_path):
    """On a CPU without AVX-512, oneDNN logs an ERROR line on the first bfloat16 op, which a
    level-2 TF_CPP_MIN_LOG_LEVEL lets through; the command spends it once its devices are set
    (kvram/_quiet.py, devices_set).
    On a CPU with AVX-512 there is no such line either way."""
    import subprocess

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", _BFLOAT16_FIT], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and "fitted" in done.stdout, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if line.startswith(("E0000", "W0000", "I0000"))] == []


@pytest.mark.slow
@pytest.mark.own_process  # run ahead, beside the suite (tests/helpers.py)
def test_plan_and_its_children_print_no_tensorflow_or_absl_line(tmp_path, request):
    """`kvram plan`'s estimate in child processes, with the user's TF_CPP_MIN_LOG_LEVEL=2
    (absl writes what TensorFlow logs before absl starts whatever the level)."""
    if in_own_process(request):
        return
    import subprocess

    script = os.path.join(os.path.dirname(sys.executable), "kvram")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The lines come from TensorFlow's start in each process, whatever the model: the
    # small one of tests/test_plan.py (ResNet50 at 224x224 took 47 s on 2 cores)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": root}
    done = subprocess.run([script, "plan", "--model", "tests.test_plan:small_model", "--batch-size", "16",
                           "--gpu-memory", "1GB", "--isolate", "always"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 0 and "<- recommended" in done.stdout, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert [line for line in lines if line.startswith(("WARNING: All log messages", "I0000", "W0000", "E0000"))] == []


@pytest.mark.slow
def test_plan_waits_on_its_child_without_importing_tensorflow():
    """`kvram plan`'s own process, which only waits on the estimate's child,
    imports no TensorFlow (kvram/_plan_process.py): -X importtime lists the
    modules the command's process imported (its child runs without it)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvram", "plan", "--model", "tests.test_plan:small_model",
         "--batch-size", "16", "--gpu-memory", "1GB", "--precision", "float32", "--micro-batch-sizes", "none",
         "--isolate", "always"],
        capture_output=True, text=True, env=env, cwd=root, timeout=300,
    )
    assert done.returncode == 0 and "<- recommended" in done.stdout, done.stderr[-3000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "kvram._plan_process" in imported, imported
    heavy = [m for m in imported if m.split(".")[0] in ("tensorflow", "keras", "numpy")]
    assert not heavy, heavy
    others = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert not any("oneDNN" in line or "absl" in line for line in others), others


def test_only_plan_with_its_estimate_in_a_child_skips_tensorflow(monkeypatch):
    from kvram import _plan_process

    monkeypatch.setattr(_plan_process, "visible_gpus", lambda: [])
    command = ["/venv/bin/kvram"]
    assert _plan_process.wanted([*command, "plan", "--model", "m", "--isolate", "always"])
    assert _plan_process.wanted(["-m", "--verbose", "plan", "--isolate=always", "--model", "m"])
    assert not _plan_process.wanted([*command, "plan", "--model", "m"])  # auto, no GPU: in this process
    assert not _plan_process.wanted([*command, "plan", "--isolate", "never"])
    assert not _plan_process.wanted([*command, "plan", "--isolate", "always", "--plan-child", "x"])  # the child
    assert not _plan_process.wanted([*command, "plan", "--isolate", "always", "--help"])
    assert not _plan_process.wanted([*command, "info", "--isolate", "always"])
    assert not _plan_process.wanted(["train.py", "plan", "--isolate", "always"])  # not the command
    monkeypatch.setattr(_plan_process, "visible_gpus", lambda: ["0"])
    assert _plan_process.wanted([*command, "plan", "--model", "m"])  # auto with a GPU


def test_quieting_is_for_the_command_alone():
    from kvram import _quiet

    bare = {}
    assert _quiet.launched_as_command(["/venv/bin/kvram", "info"])
    assert _quiet.launched_as_command(["-m", "info"])  # python -m kvram, while Python finds kvram
    assert not _quiet.launched_as_command(["train.py"]) and not _quiet.launched_as_command([])
    assert "tensorflow" in sys.modules  # here it is: nothing is left to quiet
    assert not _quiet.wanted(["/venv/bin/kvram", "info"])
    real = sys.modules.pop("tensorflow")  # as before TensorFlow's import
    try:
        assert _quiet.wanted(["/venv/bin/kvram", "info"])
        assert _quiet.wanted(["-m", "plan"])  # kvram plan's child
        assert not _quiet.wanted(["/venv/bin/kvram", "info", "--verbose"])
        assert not _quiet.wanted(["python", "train.py"])
    finally:
        sys.modules["tensorflow"] = real
    # a level the user set is kept (it governs what TensorFlow logs later); one a quieted parent set is not
    assert _quiet._users_level({"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert not _quiet._users_level({"TF_CPP_MIN_LOG_LEVEL": "3", _quiet.QUIETED: "1"})
    assert not _quiet._users_level(bare)


def test_stderr_silenced_puts_the_descriptor_back(capfd):
    from kvram import _quiet

    with _quiet.stderr_silenced():
        os.write(2, b"hidden\n")
    os.write(2, b"shown\n")
    assert capfd.readouterr().err == "shown\n"
    with pytest.raises(RuntimeError), _quiet.stderr_silenced():
        raise RuntimeError("an error inside")
    os.write(2, b"back\n")
    assert capfd.readouterr().err == "back\n"
