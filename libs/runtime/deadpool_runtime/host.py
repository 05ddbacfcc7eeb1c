"""This host's name, as members and stores report it."""

from __future__ import annotations

import socket

from deadpool_protocol.names import name_of_host

__all__ = ["host_name"]


def host_name() -> str:
    """This host's name as a DeadPool name (`name_of_host`)."""
    return name_of_host(socket.gethostname())
