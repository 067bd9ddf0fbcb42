"""Argument checks shared by kvram's public constructors (private)."""

from __future__ import annotations

import numbers


def positive_int(name: str, value, *, allow_none: bool = False):
    """Returns `value` if it is an int >= 1, else raises with the received value."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        allowed = "an int >= 1 or None" if allow_none else "an int >= 1"
        raise TypeError(
            f"`{name}` must be {allowed}. Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")
    return int(value)


def positive_float(name: str, value, *, allow_none: bool = False):
    """Returns `value` as a float if it is a finite number > 0, else raises."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        allowed = "a float > 0 or None" if allow_none else "a float > 0"
        raise TypeError(
            f"`{name}` must be {allowed}. Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    if not value > 0 or value == float("inf"):
        allowed = "a finite float > 0 or None" if allow_none else "a finite float > 0"
        raise ValueError(f"`{name}` must be {allowed}. Received: {name}={value!r}")
    return float(value)


def boolean(name: str, value) -> bool:
    """Returns `value` if it is a bool, else raises TypeError."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be True or False. Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    return value


def logical_device(name) -> str:
    """'CPU:1', '/GPU:0', ... -> the full name of a logical device that exists; TypeError for a
    name that is not a string, ValueError (listing the devices there are) for one that is not there."""
    import tensorflow as tf

    if not isinstance(name, str):
        raise TypeError(f"Devices are names like 'GPU:0'. Received: {name!r}")
    devices = tf.config.list_logical_devices()
    wanted = tf.DeviceSpec.from_string(name if name.startswith("/") else f"/device:{name}")
    for device in devices:
        spec = tf.DeviceSpec.from_string(device.name)
        if spec.device_type == (wanted.device_type or "").upper() and spec.device_index == (
            wanted.device_index or 0
        ):
            return device.name
    raise ValueError(
        f"Unknown device {name!r}. Logical devices here: {[d.name for d in devices]}. "
        "(Split one physical device into several with "
        "tf.config.set_logical_device_configuration.)"
    )
