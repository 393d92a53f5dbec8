"""The weight-sync group's store binds where it is told: rank 0 hosts a real gloo group in a
thread while the test reads the kernel's table of listening sockets."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from engines.process_group import GroupHandle, free_port, join_group, listening_socket
from tests.e2e.helpers import listeners_of

#: ``st`` of a listening socket in ``/proc/net/tcp`` and ``tcp6``.
_LISTEN = "0A"


def listeners(port: int) -> list[str]:
    """The local addresses (hex, as the kernel prints them) of every socket listening on
    ``port``, IPv4 and IPv6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and fields[3] == _LISTEN:
                found.append(address)
    return found


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


#: The kernel's hex of each loopback address, and of every interface.
_HEX = {"127.0.0.1": "0100007F", "::1": "00000000000000000000000001000000"}
_ANY = {"00000000", "00000000000000000000000000000000"}


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        pytest.param(
            "::1",
            marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback"),
        ),
    ],
)
def test_rank0_store_and_the_group_listen_on_the_master_address_alone(host: str):
    port = free_port(host)
    before = listeners_of([os.getpid()])  # what earlier tests of this worker process left listening
    handles: dict[int, GroupHandle] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            handles[rank] = join_group(
                "weights",
                master_address=host,
                master_port=port,
                rank=rank,
                world_size=2,
                store_timeout_s=120,
            )
        except BaseException as exc:  # re-raised by the test below
            errors.append(exc)

    rank0 = threading.Thread(target=join, args=(0,), daemon=True)
    rank0.start()
    deadline = time.monotonic() + 60
    while not (bound := listeners(port)) and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not errors, errors
    # rank 0 is waiting for rank 1: its store listens, on the master address and nowhere else
    assert bound == [_HEX[host]], bound
    assert not set(bound) & _ANY
    rank1 = threading.Thread(target=join, args=(1,), daemon=True)
    rank1.start()
    rank0.join(120)
    rank1.join(120)
    assert not errors, errors
    # formed: the store and gloo's own connections (both ranks here) listen on loopback alone
    assert {address for address, _ in listeners_of([os.getpid()]) - before} == {_HEX[host]}
    tensor = torch.arange(4.0)
    received = torch.zeros(4)
    sent = threading.Thread(target=handles[0].broadcast, args=(tensor,))
    sent.start()
    handles[1].broadcast(received)
    sent.join(60)
    assert received.tolist() == tensor.tolist()


def test_listening_socket_binds_the_address_it_is_given_and_refuses_one_not_here():
    port = free_port("127.0.0.1")
    with listening_socket("127.0.0.1", port):
        assert listeners(port) == [_HEX["127.0.0.1"]]
    with pytest.raises(OSError):
        listening_socket("192.0.2.1", 0)  # TEST-NET-1: never this machine's
