"""`kvram launch`: N local worker processes for `tf.distribute.MultiWorkerMirroredStrategy`.

Each worker runs the same command with its own `TF_CONFIG` (the cluster's
`localhost` addresses, its task index) and, when GPUs are present, one GPU of
its own (`CUDA_VISIBLE_DEVICES`). Their output is shown line by line, each
line prefixed with `[worker I]`. When a worker fails, the others are stopped
(a MultiWorkerMirroredStrategy job cannot go on without it: its collectives
would wait forever), and with `max_restarts` the whole job is started again,
so a script that uses `keras.callbacks.BackupAndRestore` resumes from its last
backup (the same recovery TensorFlow's multi-worker training documents; there
is no elastic re-join). For several machines, set `TF_CONFIG` on each machine
yourself: README, "From one GPU to several".

```
kvram launch --workers 2 -- python train.py --epochs 10
```
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from kvram._plan_process import describe_exit, visible_gpus

__all__ = ["launch", "free_ports", "visible_gpus"]

ATTEMPT = "KVRAM_LAUNCH_ATTEMPT"  # set in each worker: 0 first, then 1 after a restart, ...


def free_ports(count: int) -> list:
    """`count` TCP ports free on localhost now (a later bind may still race another program)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _gpus_for(workers: int, gpus) -> list:
    """One `CUDA_VISIBLE_DEVICES` value per worker (None: leave it as it is)."""
    if gpus == "none":
        return [""] * workers
    found = visible_gpus() if gpus == "auto" else [g.strip() for g in str(gpus).split(",") if g.strip()]
    if not found:
        if gpus != "auto":
            raise ValueError(f"`gpus` must be 'auto', 'none' or comma-separated GPU ids. Received: gpus={gpus!r}")
        return [None] * workers
    if len(found) < workers:
        raise ValueError(
            f"{workers} workers need {workers} GPUs, one each; {len(found)} available ({','.join(found)}). "
            "Use fewer workers, or run them on the CPU (gpus='none', on the command line --gpus none)."
        )
    return found[:workers]


def _environments(workers: int, gpus: list) -> list:
    ports = free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    environments = []
    for index in range(workers):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        if gpus[index] is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[index]
        environments.append(env)
    return environments


def _say(out, lock, text: str) -> None:
    """One whole piece of output, never interleaved with another thread's."""
    with lock:
        out.write(text)
        out.flush()


def _relay(index: int, stream, out, lock) -> None:
    for line in iter(stream.readline, ""):
        _say(out, lock, f"[worker {index}] {line}")
    stream.close()


def _stop(processes, grace_seconds: float) -> None:
    """TERM to each live worker's process group, KILL after `grace_seconds`."""
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_seconds
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _attempt(command, environments, attempt: int, grace_seconds: float, out, lock) -> tuple:
    """Runs the workers once; returns (exit code, index of the failed worker or None)."""
    processes, relays = [], []
    try:
        for index, env in enumerate(environments):
            env = dict(env, **{ATTEMPT: str(attempt)})
            p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1, start_new_session=True)
            processes.append(p)
            relays.append(threading.Thread(target=_relay, args=(index, p.stdout, out, lock), daemon=True))
            relays[-1].start()
        while True:
            codes = [p.poll() for p in processes]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                _say(out, lock, f"[kvram launch] worker {failed} {describe_exit(codes[failed])}: stopping the others\n")
                _stop(processes, grace_seconds)
                code = codes[failed]
                return (128 - code if code < 0 else code), failed
            if all(c == 0 for c in codes):
                return 0, None
            time.sleep(0.1)
    except BaseException:  # Ctrl-C or an error here: no worker outlives the launcher
        _stop(processes, grace_seconds)
        raise
    finally:
        for thread in relays:
            thread.join(timeout=5)


def launch(command, workers: int, gpus="auto", max_restarts: int = 0, grace_seconds: float = 10.0,
           out=None) -> int:
    """Runs `command` (a list: program and arguments) as `workers` local workers
    of one MultiWorkerMirroredStrategy cluster and waits for them.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        workers: int >= 1.
        gpus: "auto" (one GPU per worker when GPUs are visible, else the CPU),
            "none" (every worker on the CPU: `CUDA_VISIBLE_DEVICES=""`), or
            comma-separated GPU ids, one per worker.
        max_restarts: int >= 0, how many times the whole job is started again
            after a worker fails (new ports; each worker's `KVRAM_LAUNCH_ATTEMPT`
            says which attempt it is).
        grace_seconds: after a failure, how long the other workers get to stop
            on SIGTERM before SIGKILL.
        out: where the workers' prefixed output goes (default sys.stdout).

    Returns:
        0 when every worker exited with 0, else the failed worker's exit code
        (128 + N for a worker killed by signal N) after the last attempt.

    Raises:
        ValueError: for bad arguments, or fewer GPUs than workers.
        FileNotFoundError: `command[0]` is neither on PATH nor an executable file.
    """
    if isinstance(command, str) or not command or not all(isinstance(c, str) for c in command):
        raise ValueError(
            "`command` must be a non-empty list of strings (program and arguments), e.g. "
            f"['python', 'train.py']. Received: command={command!r}"
        )
    for name, value, least in (("workers", workers, 1), ("max_restarts", max_restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"`{name}` must be an int >= {least}. Received: {name}={value!r}")
    if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, (int, float)) or grace_seconds < 0:
        raise ValueError(f"`grace_seconds` must be a number >= 0. Received: grace_seconds={grace_seconds!r}")
    if shutil.which(command[0]) is None:
        raise FileNotFoundError(
            f"{command[0]}: no such command (not on PATH, nor an executable file); no worker was "
            f"started. Received: command={command!r}"
        )
    assigned = _gpus_for(workers, gpus)
    out = out or sys.stdout
    lock = threading.Lock()
    if all(g is None for g in assigned):
        where = "no GPU found: devices as TensorFlow finds them"
    elif all(g == "" for g in assigned):
        where = "on the CPU"
    else:
        where = ", ".join(f"worker {i}: GPU {g}" for i, g in enumerate(assigned))
    for attempt in range(max_restarts + 1):
        _say(out, lock, f"[kvram launch] {workers} worker(s), attempt {attempt + 1} of {max_restarts + 1} "
                        f"({where}): {' '.join(command)}\n")
        code, failed = _attempt(command, _environments(workers, assigned), attempt, grace_seconds, out, lock)
        if code == 0:
            return 0
        if attempt < max_restarts:
            _say(out, lock, f"[kvram launch] restarting every worker (worker {failed} failed)\n")
    return code
