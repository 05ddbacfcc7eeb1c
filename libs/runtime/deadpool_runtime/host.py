"""This host's name, as members and stores report it, and its address as other hosts reach it."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from urllib.parse import urlsplit

from deadpool_protocol.names import name_of_host

__all__ = ["address_towards", "host_name", "interface_of"]

LOOPBACK = "127.0.0.1"
SIOCGIFADDR = 0x8915
"""Linux's ioctl for an interface's IPv4 address."""


def host_name() -> str:
    """This host's name as a DeadPool name (`name_of_host`)."""
    return name_of_host(socket.gethostname())


def address_towards(url: str) -> str:
    """This host's address on its route to `url`'s host (a NATS server): the address hosts that reach
    that server can reach this one at, as a rendezvous needs. Loopback when the server is on this
    host. No packet is sent: connecting a UDP socket only chooses the route.

    Raises OSError when there is no route (or the name does not resolve)."""
    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    host, port = parts.hostname or "localhost", parts.port or 4222
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    if ipaddress.ip_address(address[0]).is_loopback:
        return LOOPBACK
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        own: str = probe.getsockname()[0]
    return own


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds IPv4 `address` ('' if none does): gloo
    binds by interface name (`GLOO_SOCKET_IFNAME`), and left to itself picks the address the host name
    resolves to, which another host may not reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface with no IPv4 address
                request = struct.pack("256s", name.encode()[:15])
                if socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24]) == address:
                    return name
    return ""
