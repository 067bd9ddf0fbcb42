"""The old home of `estimate`, `measure`, `Estimate`, `Configuration` and
`parse_bytes`, now in `kvram.remat` beside `kvram.remat.plan`. Each name here
still works and warns (DeprecationWarning) once used."""

import warnings

from kvram import remat as _remat

_MOVED = ("estimate", "measure", "Estimate", "Configuration", "parse_bytes")
__all__ = list(_MOVED)


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(
            f"kvram.plan.{name} is now kvram.remat.{name}; kvram.plan will be removed in a later release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_remat, name)
    raise AttributeError(f"module 'kvram.plan' has no attribute {name!r}")
