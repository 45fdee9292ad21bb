"""The torch.distributed groups of a rank: gloo for control, and the device group (gloo on the
CPU, NCCL on CUDA) that the layers' all-reduces and the sampler's gathers use.

Rendezvous is on rank 0's TCPStore: rank 0 listens (``is_master``), the others connect to
``master_addr:master_port``; the same store serves ranks on other hosts. torch's store binds
the wildcard address whatever host it is given, so rank 0 binds the listening socket to the
master address itself and hands it over, and stops listening once the groups have met (nothing
uses the store after: gloo's pairs and NCCL's communicator are connected by then). Nothing
pickled passes through the store or the groups: the store carries gloo's and NCCL's own
address records, the groups carry tensors (round_command.py encodes a round as one).

Every collective has the group's ``timeout``: a rank that stops answering makes the others'
collectives raise instead of hanging, and the caller stops the group (fail-stop, see launch.py).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ProcessGroups:
    rank: int
    world_size: int
    control: dist.ProcessGroup
    """gloo: plans, commands, start and stop."""
    device: dist.ProcessGroup
    """The tensors' backend: gloo on the CPU, NCCL on CUDA."""
    store: dist.TCPStore | None
    """The rendezvous store, kept until the groups close (None once closed)."""

    def close(self) -> None:
        """Leave the groups (their sockets close)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def device_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors (gloo's all-reduce on the CPU is its ring)."""
    return "nccl" if device.type == "cuda" else "gloo"


def rendezvous_listener(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket, bound to ``host`` only (port 0: a free one)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise OSError(f"the tensor-parallel rendezvous cannot listen on {host}:{port}: {error}") from None
    return listener


def stop_listening(listener: socket.socket) -> None:
    """The store accepts no new connection (the ranks' own stay open): shutting the socket down
    takes it out of LISTEN for the store's copy of it too."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


def rendezvous_store(
    rank: int, world_size: int, host: str, port: int, timeout: timedelta, listener: socket.socket | None = None
) -> dist.TCPStore:
    """Rank 0 creates the store on ``listener`` (rendezvous_listener); the others connect to
    ``host:port``, waiting up to ``timeout``."""
    if rank == 0:
        assert listener is not None
        port = listener.getsockname()[1]
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        # A copy: the store closes the descriptor it is given, and the listener is closed apart.
        master_listen_fd=os.dup(listener.fileno()) if listener is not None else None,
    )


def join_groups(
    rank: int,
    world_size: int,
    store: dist.TCPStore,
    device: torch.device,
    timeout: timedelta,
    master_addr: str,
) -> ProcessGroups:
    """Join the default (control, gloo) group and create the device group on every rank. On the
    master address's host gloo listens on that address's interface, not the hostname's."""
    interface = interface_of(master_addr)
    if interface is not None:
        # gloo's default device reads its interface from here only (an operator's choice wins).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.group.WORLD
    assert control is not None
    backend = device_backend(device)
    device_group = control if backend == "gloo" else dist.new_group(backend=backend, timeout=timeout)
    return ProcessGroups(rank=rank, world_size=world_size, control=control, device=device_group, store=store)


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 ``address`` (None: another
    host's address, a name, or IPv6)."""
    try:
        wanted = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if ipaddress.IPv4Address(answer[20:24]) == wanted:
                return name
    return None


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over the ranks in place, on the default group: what a rank's model calls
    after its row-split layers (gloo on the CPU; a CUDA model would pass its NCCL device group's
    all-reduce instead)."""
    dist.all_reduce(tensor)
