"""kvram's switches in the environment: each is on unless its variable is "0"."""

from __future__ import annotations

import os


def switched_off(name: str, environ=None) -> bool:
    """Whether the environment variable `name` turns its switch off: it is "0"
    (blanks around it ignored). Unset, empty or anything else leaves it on."""
    environ = os.environ if environ is None else environ
    return environ.get(name, "1").strip() == "0"
