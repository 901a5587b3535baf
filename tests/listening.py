"""What a process listens on, read from /proc: the TCP sockets in LISTEN among its open files."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

_TCP_LISTEN = "0A"


def listening_addresses(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of process `pid` in LISTEN."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _TCP_LISTEN and inode in inodes:
                found.add(_address(local, family))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, written as IPv4, IPv6 or IPv4-mapped IPv6 ("::ffff:127.0.0.1")."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _address(local: str, family: int) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" (32-bit words in host order) as ("127.0.0.1", 8080)."""
    hex_address, hex_port = local.split(":")
    words = [int(hex_address[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(hex_address), 8)]
    return socket.inet_ntop(family, b"".join(words)), int(hex_port, 16)
