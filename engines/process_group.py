"""A stateless weight-sync process group: one ``TCPStore`` plus one gloo or NCCL group.

The primitive both ends of the broadcast transports use: policy rank 0 in the trainer
(through :mod:`sync.group`, which bounds the init on the controller side) and the reference
server's ``/init_weight_transfer_engine`` (which joins in a thread). It lives here because
engines may not import ``sync``. No ``torch.distributed`` global (default-group) state is
touched, as with vLLM's weight-transfer groups.

Rank 0's store listens on ``master_address`` alone, never on every interface (torch's
``TCPStore`` binds ``*:PORT`` when it makes its own socket): :func:`listening_socket` binds
it and the store is handed the listening descriptor (``master_listen_fd``), as vLLM's
``StatelessProcessGroup`` does.

``backend="nccl"`` (GPU only: :func:`require_cuda` refuses it on a machine without CUDA)
forms the group the way vLLM's ``nccl`` weight-transfer backend does when vLLM is
importable in this process (``nccl_common.stateless_init_process_group``: vLLM's
``StatelessProcessGroup`` rendezvous, then its ``PyNcclCommunicator``), which is what a
real vLLM server's workers expect; without vLLM, torch's ``ProcessGroupNCCL`` over the
``TCPStore`` (which both halves of this project speak). Not yet run on a GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from trainer.vocabulary import fire_fault_sync

__all__ = [
    "BACKSTOP_S",
    "GroupBackend",
    "GroupHandle",
    "free_port",
    "join_group",
    "listening_socket",
    "require_cuda",
    "tcp_store",
]

#: The collective backends of a weight-sync group.
GroupBackend = Literal["gloo", "nccl"]

OP = "init_process_group"

#: Added to the controller's bound for a participant's own store timeout, so a thread the
#: controller gave up on ends on its own instead of staying blocked for the process' life.
BACKSTOP_S = 5.0


@attrs.define(eq=False)
class GroupHandle:
    """One participant's membership in a built group (reused by every sync)."""

    #: The group's name (in errors and logs).
    name: str
    #: This participant's rank and the group's size.
    rank: int
    world_size: int
    #: The store (rank 0 hosts it) and the group over it.
    store: Any
    group: Any
    #: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
    backend: GroupBackend = "gloo"
    #: The CUDA device of an ``nccl`` group's tensors; None for gloo.
    device: torch.device | None = None

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Blocking broadcast of ``tensor`` from ``src`` (call it from a thread, never the loop).

        ``timeout_s`` bounds this collective (default: the group's own timeout).
        """
        work = self.broadcast_async(tensor, src, timeout_s=timeout_s)
        if work is not None:
            work.wait()

    def broadcast_async(
        self, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
    ) -> Any:
        """Start a broadcast; a handle whose ``wait()`` blocks until it is done (None: done).

        Gloo runs it on its own threads, so the caller can prepare the next buffer meanwhile
        (neither call holds the GIL while it waits). NCCL enqueues it on the device.
        """
        if self.store is None:
            # vLLM's PyNcclCommunicator (no torch store): enqueued on the current stream
            self.group.broadcast(tensor, src=src, stream=torch.cuda.current_stream())
            return _StreamDone()
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        return self.group.broadcast(tensor, src, timeout)


class _StreamDone:
    """The ``wait()`` of a broadcast enqueued on the current CUDA stream."""

    def wait(self) -> None:
        torch.cuda.current_stream().synchronize()


def require_cuda(what: str) -> torch.device:
    """The current CUDA device, or ``RuntimeError`` saying ``what`` needs one (a CPU machine)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs CUDA, and this process sees no CUDA device (torch "
            f"{torch.__version__}); on a CPU machine use the gloo stand-in, which sends the "
            "same messages"
        )
    return torch.device("cuda", torch.cuda.current_device())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (a name or an IPv4 or IPv6 address) that was free a moment ago
    (for a group's store, or a server's ``--port``): bound on ``host`` alone to find it, and
    closed at once, so another process may take it before its user binds it."""
    family, address = _address_of(host, 0)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(address)
        return s.getsockname()[1]


def _address_of(host: str, port: int) -> tuple[socket.AddressFamily, Any]:
    """The family and socket address of ``host:port`` (a name: its first TCP address)."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not info:
        raise OSError(f"{host!r} has no TCP address")
    family, _type, _proto, _name, address = info[0]
    return family, address


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` alone (``SO_REUSEADDR``, as torch's own), listening.

    ``OSError`` when ``host`` is not an address of this machine or the port is taken."""
    family, address = _address_of(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store(
    address: str, port: int, world_size: int, rank: int, timeout: datetime.timedelta
) -> Any:
    """A group's ``TCPStore``: rank 0 hosts it on ``address`` alone (the descriptor of
    :func:`listening_socket`, which the store then owns and closes), the others connect.
    Also the store of the Ray workers' data-parallel group (``init_process_group(store=)``),
    whose ``tcp://`` rendezvous would listen on every interface."""
    if rank != 0:
        return dist.TCPStore(
            address, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False
        )
    fd = listening_socket(address, port).detach()
    try:
        return dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def join_group(
    name: str,
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    store_timeout_s: float,
    step: int | None = None,
    backend: GroupBackend = "gloo",
) -> GroupHandle:
    """Join (rank 0: host) group ``name``; blocking, so run it in a thread or a process.

    Fires the ``init_process_group`` fault first (where the init really runs). Blocks until
    every rank has joined or ``store_timeout_s`` passes (the participant's backstop; the
    controller's bound is :func:`init_group`'s). ``backend="nccl"`` raises ``RuntimeError``
    at once where there is no CUDA.
    """
    fire_fault_sync(OP, step)
    timeout = datetime.timedelta(seconds=store_timeout_s)
    if backend == "nccl":
        return _join_nccl(name, master_address, master_port, rank, world_size, timeout)
    store = tcp_store(master_address, master_port, world_size, rank, timeout)
    prefixed = dist.PrefixStore(f"{name}/", store)
    group = dist.ProcessGroupGloo(
        prefixed, rank, world_size, _gloo_options(master_address, timeout)
    )
    return GroupHandle(name, rank, world_size, store, group)


def _local_address_toward(peer: str) -> str:
    """This machine's address on the route to ``peer`` (loopback for a loopback ``peer``; no
    packet is sent: a UDP socket's ``connect`` only picks the route)."""
    family, address = _address_of(peer, 9)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def _gloo_options(master_address: str, timeout: datetime.timedelta) -> Any:
    """Gloo's options with its device on the address that reaches ``master_address`` (rank 0:
    that address), so the group's own connections listen there too, not on whatever this
    machine's hostname resolves to; ``GLOO_SOCKET_IFNAME``, where set, still chooses."""
    # torch has no public way to name a gloo group's device: these are what its own
    # init_process_group sets (torch/distributed/distributed_c10d.py, _new_process_group_helper)
    options = dist.ProcessGroupGloo._Options()  # noqa: SLF001
    options._timeout = timeout  # noqa: SLF001
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        device = dist.ProcessGroupGloo.create_default_device()
    else:
        device = dist.ProcessGroupGloo.create_device(hostname=_local_address_toward(master_address))
    options._devices = [device]  # noqa: SLF001
    return options


def _join_nccl(
    name: str, address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> GroupHandle:
    """An NCCL group: vLLM's rendezvous when vLLM is importable, else torch's (see above)."""
    device = require_cuda(f"weight-sync group {name!r} (backend nccl)")
    try:
        from vllm.distributed.weight_transfer.nccl_common import (  # optional: GPU machines
            stateless_init_process_group,
        )
    except ImportError:
        stateless_init_process_group = None
    if stateless_init_process_group is not None:
        comm = stateless_init_process_group(address, port, rank, world_size, device.index)
        return GroupHandle(name, rank, world_size, None, comm, "nccl", device)
    store = tcp_store(address, port, world_size, rank, timeout)
    # each broadcast passes its own timeout (broadcast_async), as with gloo
    options = dist.ProcessGroupNCCL.Options()
    group = dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}/", store), rank, world_size, options)
    # NCCL makes its communicator at the first collective unless told the device now: connect
    # here, so a group that cannot form fails inside the bounded init, not in the first sync
    # (as torch's init_process_group(device_id=...) does; absent in older torch: lazy, as before)
    connect = getattr(group, "eager_connect_single_device", None)
    if connect is not None:
        connect(device)
    return GroupHandle(name, rank, world_size, store, group, "nccl", device)
