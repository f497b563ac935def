"""Sizes as people write them, one grammar everywhere: the connector's ``store_bytes`` /
``disk_bytes`` / ``staging_bytes``, ``kvstride store serve --bytes``, and the command's
``--store-bytes``, ``--capacity`` and ``--disk-bytes`` all take a byte count or a number with a
unit, binary whatever its spelling: ``512M``, ``512MB`` and ``512MiB`` are each 512 x 2^20."""

from __future__ import annotations

import re
from typing import Any

_UNITS = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(?:i?b)?|b)?\s*$", re.IGNORECASE)


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string like "8GB", "512MB", "64M", "1.5 GiB", "4TiB" (units of 1024)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{name} must be a byte count or a string like '8GiB', got {value!r}")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise ValueError(f"{name} {value!r} is not a size: use bytes or a number with K, M, G, T or P "
                             "(binary: MiB, GiB, TiB), e.g. '512MiB' or '4TiB'")
        number, unit = match.groups()
        return int(float(number) * _UNITS[unit and unit.lower()])  # "1.1GB" rounds down, as in vLLM
    if value < 0 or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} must be a whole, non-negative number of bytes, got {value!r}")
    return int(value)


def format_size(nbytes: int) -> str:
    """``nbytes`` as a person reads it, in the units ``parse_size`` takes: "64 MiB", "1.5 GiB",
    "4 KiB"; bytes below 1 KiB as they are."""
    value, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{int(value)} B" if unit == "B" else f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"
