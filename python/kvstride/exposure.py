"""What this process actually listens on (honest exposure).

``listening_sockets()`` reads the kernel's socket tables (``/proc/net/tcp``, ``/proc/net/tcp6``)
and keeps the LISTEN sockets whose inodes this process holds open (``/proc/self/fd``): measured,
not assumed from flags. Mooncake's TCP transport listens on every interface whatever address it
is given (its data acceptor binds ``[::]`` dual-stack, see docs/OPERATING.md, "Trust model"), and anyone
who reaches that port can read and write any memory of this process; logging what is open
makes that visible.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import List, NamedTuple, Optional

__all__ = ["Listener", "listening_sockets", "describe", "log_listeners"]

log = logging.getLogger("kvstride.exposure")

_LISTEN = "0A"


class Listener(NamedTuple):
    address: str  # "0.0.0.0", "::", "127.0.0.1", ...
    port: int
    family: str  # "tcp" or "tcp6"

    @property
    def wildcard(self) -> bool:
        return self.address in ("0.0.0.0", "::")

    @property
    def loopback(self) -> bool:
        addr = ipaddress.ip_address(self.address)
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def _address(hex_addr: str, family: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == "tcp":
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # tcp6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _own_socket_inodes(pid: Optional[int]) -> set:
    fd_dir = f"/proc/{pid or 'self'}/fd"
    inodes = set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening_sockets(pid: Optional[int] = None) -> List[Listener]:
    """The TCP sockets process ``pid`` (default: this one) listens on, sorted; [] where /proc
    is not available."""
    try:
        inodes = _own_socket_inodes(pid)
    except OSError:
        return []
    found = set()
    for family in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid or 'self'}/net/{family}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN or fields[9] not in inodes:
                continue
            hex_addr, hex_port = fields[1].split(":")
            found.add(Listener(_address(hex_addr, family), int(hex_port, 16), family))
    return sorted(found, key=lambda s: (s.port, s.family, s.address))


def describe(listeners: List[Listener]) -> str:
    if not listeners:
        return "none found"
    parts = [f"{s}{' (all interfaces)' if s.wildcard else ''}" for s in listeners]
    return ", ".join(parts)


def log_listeners(who: str, pid: Optional[int] = None, level: int = logging.INFO, only=None) -> List[Listener]:
    """Log the sockets process ``pid`` (default: this one) listens on, or ``only`` these (measured
    by the caller); a warning when some listen on all interfaces."""
    listeners = listening_sockets(pid) if only is None else list(only)
    wild = [s for s in listeners if s.wildcard]
    if wild:
        log.warning(
            "%s: listens on %s; %d of them on all interfaces: whoever reaches those ports can read and write "
            "any memory of that process (Mooncake's TCP transport has no authentication and takes the address "
            "a peer names); keep it on an isolated network (docs/OPERATING.md: Trust model)", who, describe(listeners), len(wild),
        )
    else:
        log.log(level, "%s: listens on %s", who, describe(listeners))
    return listeners
