"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict` (a broken link,
a missing reference or a docstring that does not match its signature fails), its API reference names
every public name, and the Quickstart's Python code runs as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow  # a site build and a child process


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _public_names():
    import kvram

    names = ["kvram.Model"]
    for module in ("layers", "remat", "precision", "speed", "callbacks", "data", "parallel", "memory"):
        names += [f"kvram.{module}.{name}" for name in getattr(kvram, module).__all__]
    return names


def test_the_site_builds_strict_and_its_reference_names_every_public_name(site):
    ids = set()
    for page in (site / "reference").rglob("index.html"):
        ids |= set(re.findall(r'id="(kvram\.[A-Za-z0-9_.]+)"', page.read_text()))
    missing = [name for name in _public_names() if name not in ids]
    assert not missing, missing
    for page in ("index.html", "quickstart/index.html", "memory/index.html", "benchmarks/index.html",
                 "guides/checkpointing/index.html", "guides/cli/index.html"):
        assert (site / page).is_file(), page


def test_the_quickstart_runs_as_written(tmp_path):
    text = open(os.path.join(ROOT, "docs", "quickstart.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    script = tmp_path / "quickstart.py"
    script.write_text("\n".join(blocks))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped steps 0" in done.stdout
    assert "kvram.remat plan for" in done.stdout
