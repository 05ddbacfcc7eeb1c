"""A host's address as other hosts reach it: the route to the NATS server, and the interface gloo binds."""

from __future__ import annotations

import pytest

from deadpool_runtime.host import address_towards, interface_of


@pytest.mark.parametrize(
    "url", ["nats://127.0.0.1:4222", "127.0.0.1:4222", "nats://localhost:4222", "tls://127.0.0.2:1,nats://10.0.0.1:2"]
)
def test_a_server_on_this_host_keeps_the_rendezvous_on_loopback(url: str) -> None:
    assert address_towards(url) == "127.0.0.1"


def test_the_interface_of_an_address_is_found_and_an_address_no_interface_holds_is_not() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") == ""  # TEST-NET-1: held by no interface here
