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
