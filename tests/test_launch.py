"""`kvram launch`: local MultiWorkerMirroredStrategy workers (processes without TensorFlow here;
tests/test_distribute.py trains through it)."""

import io
import json
import sys

import pytest

from kvram import cli
from kvram.parallel import _launch as launch

WORKER = r'''
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index, attempt = config["task"]["index"], int(os.environ["KVRAM_LAUNCH_ATTEMPT"])
with open(os.path.join(sys.argv[1], f"w{index}_a{attempt}.json"), "w") as f:
    json.dump({"config": config, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
print(f"hello from {index}", flush=True)
mode = sys.argv[2] if len(sys.argv) > 2 else ""
if attempt == 0 and index == 1 and mode in ("fail", "kill"):
    # fails only once worker 0 has written its file: the order is a handshake, not a race
    for _ in range(6000):
        if os.path.exists(os.path.join(sys.argv[1], "w0_a0.json")):
            break
        time.sleep(0.05)
    if mode == "fail":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
if attempt == 0 and index == 0 and mode in ("fail", "kill"):
    time.sleep(120)  # stopped by the launcher when worker 1 fails
    open(os.path.join(sys.argv[1], "w0_slept"), "w").close()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def seen(tmp_path, index, attempt=0):
    return json.loads((tmp_path / f"w{index}_a{attempt}.json").read_text())


def test_each_worker_gets_the_cluster_and_its_index(tmp_path, script):
    out = io.StringIO()
    assert launch.launch([sys.executable, str(script), str(tmp_path)], 3, gpus="none", out=out) == 0
    configs = [seen(tmp_path, i) for i in range(3)]
    cluster = configs[0]["config"]["cluster"]
    assert len(set(cluster["worker"])) == 3 and all(a.startswith("localhost:") for a in cluster["worker"])
    for i, c in enumerate(configs):
        assert c["config"] == {"cluster": cluster, "task": {"type": "worker", "index": i}}
        assert c["cuda"] == ""  # gpus="none": every worker on the CPU
        assert f"[worker {i}] hello from {i}\n" in out.getvalue()


def test_one_gpu_per_worker_from_cuda_visible_devices(tmp_path, script, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    assert launch.visible_gpus() == ["3", "5", "6"]
    out = io.StringIO()
    assert launch.launch([sys.executable, str(script), str(tmp_path)], 2, out=out) == 0
    assert [seen(tmp_path, i)["cuda"] for i in range(2)] == ["3", "5"]
    assert "worker 0: GPU 3, worker 1: GPU 5" in out.getvalue()
    assert launch.launch([sys.executable, str(script), str(tmp_path)], 2, gpus="1,0", out=out) == 0
    assert [seen(tmp_path, i)["cuda"] for i in range(2)] == ["1", "0"]


@pytest.mark.parametrize("mode,code,said", [("fail", 3, "exited with code 3"), ("kill", 137, "was killed by SIGKILL")])
def test_a_failed_worker_stops_the_others_and_gives_its_code(tmp_path, script, mode, code, said):
    out = io.StringIO()
    result = launch.launch([sys.executable, str(script), str(tmp_path), mode], 2, gpus="none",
                           grace_seconds=2, out=out)
    assert result == code
    assert f"[kvram launch] worker 1 {said}: stopping the others" in out.getvalue()
    # worker 0 would sleep 120 s and then write w0_slept: the launcher stopped it instead of waiting
    assert not (tmp_path / "w0_slept").exists()


def test_max_restarts_starts_every_worker_again(tmp_path, script):
    out = io.StringIO()
    assert launch.launch([sys.executable, str(script), str(tmp_path), "fail"], 2, gpus="none",
                         max_restarts=1, grace_seconds=2, out=out) == 0
    text = out.getvalue()
    assert "attempt 1 of 2" in text and "attempt 2 of 2" in text
    assert "restarting every worker (worker 1 failed)" in text
    # new ports for the second attempt, each worker told which attempt it is
    first, second = seen(tmp_path, 0, 0)["config"], seen(tmp_path, 0, 1)["config"]
    assert first["task"] == second["task"] and len(second["cluster"]["worker"]) == 2
    assert seen(tmp_path, 1, 1)["config"]["task"]["index"] == 1


def test_bad_arguments_say_what_was_received(tmp_path, script, monkeypatch):
    command = [sys.executable, str(script), str(tmp_path)]
    with pytest.raises(ValueError, match=r"`workers` must be an int >= 1. Received: workers=0"):
        launch.launch(command, 0)
    with pytest.raises(ValueError, match=r"`max_restarts` must be an int >= 0. Received: max_restarts=-1"):
        launch.launch(command, 1, max_restarts=-1)
    with pytest.raises(ValueError, match=r"`command` must be a non-empty list of strings.*Received: command='python train.py'"):
        launch.launch("python train.py", 1)
    with pytest.raises(ValueError, match=r"2 workers need 2 GPUs, one each; 1 available \(0\)"):
        launch.launch(command, 2, gpus="0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch.visible_gpus() == []


def test_command_line(tmp_path, script, capsys):
    assert cli.main(["launch", "--workers", "2", "--gpus", "none", "--", sys.executable, str(script),
                     str(tmp_path)]) == 0
    assert "[worker 1] hello from 1" in capsys.readouterr().out
    assert cli.main(["launch", "--workers", "2"]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert cli.main(["launch", "--workers", "2", "--gpus", "0", "--", sys.executable, str(script)]) == 2
    assert "2 workers need 2 GPUs" in capsys.readouterr().err
