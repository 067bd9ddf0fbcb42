"""kvram's switches in the environment (`kvram._env`)."""

import pytest

from kvram._env import switched_off


@pytest.mark.parametrize("value, off", [("0", True), (" 0\n", True), ("1", False), ("", False), ("no", False),
                                        ("00", False), (None, False)])
def test_a_switch_is_off_only_when_its_variable_is_zero(value, off):
    environ = {} if value is None else {"KVRAM_SOME_SWITCH": value}
    assert switched_off("KVRAM_SOME_SWITCH", environ) is off


def test_the_process_environment_is_read_when_none_is_given(monkeypatch):
    monkeypatch.setenv("KVRAM_SOME_SWITCH", "0")
    assert switched_off("KVRAM_SOME_SWITCH")
    monkeypatch.delenv("KVRAM_SOME_SWITCH")
    assert not switched_off("KVRAM_SOME_SWITCH")


def test_import_kvram_under_another_keras_backend_says_it_needs_tensorflow():
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", "import kvram"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KERAS_BACKEND": "jax"})
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "ImportError: kvram needs Keras's TensorFlow backend, and Keras's backend here is 'jax' "
        "(KERAS_BACKEND='jax'). Set KERAS_BACKEND=tensorflow, or leave it unset, before Keras is first imported.")
    assert "site-packages" not in result.stderr  # refused before Keras or TensorFlow is imported
