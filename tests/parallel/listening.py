"""The TCP addresses a set of processes listens on, read from /proc as `ss -ltnp` reads them."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"


def _address(hex_address: str) -> str:
    """/proc/net/tcp's address: 32-bit words in the host's (little-endian) byte order."""
    words = bytes.fromhex(hex_address)
    raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    return str(ipaddress.ip_address(raw))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket (IPv4 and IPv6) the processes hold."""
    found = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN and inode in inodes:
                    address, port = local.split(":")
                    found.add((_address(address), int(port, 16)))
    return found
