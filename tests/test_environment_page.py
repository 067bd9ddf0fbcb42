"""docs/environment.md names every process-wide change `import kvram` makes: each environment
variable the package reads or sets, found in its source, not listed here."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_variables() -> set:
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "kvram")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    found |= set(re.findall(r'"(KVRAM_[A-Z_]+)"', f.read()))
    return found


def test_the_environment_page_names_every_variable_kvram_reads_or_sets():
    with open(os.path.join(ROOT, "docs", "environment.md")) as f:
        page = f.read()
    variables = _package_variables() | {"KERAS_BACKEND", "TF_ENABLE_ONEDNN_OPTS", "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL"}
    assert {"KVRAM_XLA_FLAGS", "KVRAM_PIN_HOST_MEMORY", "KVRAM_TENSORDOT_EINSUM"} <= variables  # the walk finds them
    assert sorted(v for v in variables if f"`{v}" not in page) == []
    from kvram import _xla_flags

    assert all(flag in page for flag in _xla_flags.FAST)
