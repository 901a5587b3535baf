"""The UCX plumbing under kv_transfer/ucx.py: the process's one UCX event loop, the
connection of two UCX workers through a TCP link, and framed sends and receives on a ucxx
endpoint (protobuf frames under one tag, raw tensor bytes under another). See ucx.py for
why there is one loop per process.

Where UCX listens: the process's UCX uses only the network device that holds its KV host
(`net_devices`), so its TCP transport listens on that address alone (the loopback device
for 127.0.0.1). UCX_NET_DEVICES in the environment overrides it. Peers find each other
through the receiver's TCP link (`connect` / `accept`), bound to the KV host, never
through a UCX listener: ucxx's listeners take no address and bind every interface.
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch
import ucxx

from vllm_cluster.kv_transfer.base import KVTransferError, flat_bytes, unpack_frame

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONNECT_TIMEOUT_S = 10.0
_PEER = struct.Struct("<QI")  # on the TCP link: the tag the peer must send under, address length
_MAX_ADDRESS_BYTES = 1 << 20
_SIOCGIFADDR = 0x8915
MAX_FRAME_BYTES = 1 << 16  # the frame receive buffer; the sender packs frames to fit
# Headers and bytes travel under two tags so that frame receives can be posted ahead of
# the byte receives they announce; UCX matches each tag's messages in posting order.
FRAME_TAG, BYTES_TAG = 1, 2


class _Closable(Protocol):
    def close(self) -> None: ...


class UcxLoop:
    """The process's one asyncio loop for UCX, in a daemon thread, started on first use."""

    _instance: ClassVar[UcxLoop | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls, on_cpu: bool, host: str) -> UcxLoop:
        """The process's loop; its UCX uses the devices of `host`, the process's KV host."""
        devices = net_devices(host)
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(on_cpu, devices)
            elif cls._instance.net_devices != devices:
                raise KVTransferError(
                    f"this process's UCX already serves KV on {cls._instance.net_devices or 'every device'}; "
                    f"{host!r} needs {devices or 'every device'}: give every sender and receiver of a "
                    "process the same KV host"
                )
            return cls._instance

    def __init__(self, on_cpu: bool, devices: str | None) -> None:
        self.net_devices = devices
        self.loop = asyncio.new_event_loop()
        self.open_objects: weakref.WeakSet[_Closable] = weakref.WeakSet()
        thread = threading.Thread(target=self.loop.run_forever, name="kv-transfer-ucx", daemon=True)
        thread.start()
        self.run(self._init_ucx(on_cpu, devices), CONNECT_TIMEOUT_S)
        atexit.register(self._close_open_objects)

    @staticmethod
    async def _init_ucx(on_cpu: bool, devices: str | None) -> None:
        # Runs in the loop so that ucxx binds its request notifier to it. ucxx itself sets
        # UCX_MEMTYPE_CACHE, which this UCX build does not know and warns about on stderr.
        # Explicit UCX_* settings in the environment win over these.
        options = {"WARN_UNUSED_ENV_VARS": "n"}
        if on_cpu:
            options["TLS"] = "tcp"  # between host buffers
        if devices is not None:
            options["NET_DEVICES"] = devices
        try:
            ucxx.init(options=options, env_takes_precedence=True, enable_python_future=True)
        except RuntimeError as e:
            raise KVTransferError(
                "ucxx was initialised before kv_transfer started its UCX loop; let "
                "kv_transfer be the first user of ucxx in this process"
            ) from e

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop and wait for its result (never call from the loop itself)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _close_open_objects(self) -> None:
        # Endpoints torn down by the interpreter's exit print tracebacks; close them first.
        for obj in list(self.open_objects):
            obj.close()


def as_buffer(tensor: torch.Tensor) -> Any:
    """What ucxx sends from or receives into: the tensor's bytes, in place."""
    data = flat_bytes(tensor)
    return data if data.is_cuda else data.numpy()  # CUDA: __cuda_array_interface__


def _top_up_futures() -> None:
    """ucxx gives every request a future from a per-process pool of 100 that only its
    notifier thread refills (when under 50), and warns on stderr each time the pool runs
    dry; top it up before each request (a no-op while 50 or more are left)."""
    ucxx.core._get_ctx().worker.populate_python_futures_pool()


async def send(ep: Any, buffer: Any, tag: int) -> None:
    _top_up_futures()
    await ep.send(buffer, tag=tag)


async def recv(ep: Any, buffer: Any, tag: int) -> None:
    _top_up_futures()
    await ep.recv(buffer, tag=tag)


async def send_frame(ep: Any, frame: bytes) -> None:
    await send(ep, np.frombuffer(frame, dtype=np.uint8), FRAME_TAG)


async def recv_frame(ep: Any) -> list[bytes]:
    """The protobufs of the next frame, received into a buffer of the largest frame size
    (UCX accepts a shorter message; the frame's zero length marks its end)."""
    buffer = np.empty(MAX_FRAME_BYTES, dtype=np.uint8)
    await recv(ep, buffer, FRAME_TAG)
    return unpack_frame(buffer.data.cast("B").tobytes())


def net_devices(host: str) -> str | None:
    """UCX_NET_DEVICES for a process whose KV peers reach it at `host`: the loopback device
    for a loopback address; else the interface holding that address, plus the RDMA ports
    (which listen on no address); None (every device) for a wildcard or an address no
    interface holds."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if address.is_unspecified:
        return None
    if address.is_loopback:
        return _interface_of("127.0.0.1") or "lo"
    name = _interface_of(str(address))
    if name is None:
        logger.warning("no network interface holds the KV host %s: UCX may listen on every device", host)
        return None
    return ",".join([name, *_rdma_ports()])


def _interface_of(address: str) -> str | None:
    """The interface whose (primary) IPv4 address is `address`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _rdma_ports() -> list[str]:
    """UCX's names for this machine's RDMA ports: "mlx5_0:1", ..."""
    return sorted(f"{port.parent.parent.name}:{port.name}" for port in Path("/sys/class/infiniband").glob("*/ports/*"))


async def connect(host: str, port: int) -> tuple[Any, asyncio.StreamReader, asyncio.StreamWriter]:
    """A sender's endpoint to the receiver whose TCP link listens on host:port, and that
    link: the sender keeps it open as long as it uses the endpoint."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    try:
        recv_tag = _new_tag()
        writer.write(_peer_message(recv_tag))
        await writer.drain()
        send_tag, address = await asyncio.wait_for(_read_peer(reader), CONNECT_TIMEOUT_S)
        return await _endpoint(address, send_tag, recv_tag), reader, writer
    except BaseException:
        writer.close()
        raise


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
    """The receiver's endpoint to a sender that opened a TCP link to it."""
    send_tag, address = await asyncio.wait_for(_read_peer(reader), CONNECT_TIMEOUT_S)
    recv_tag = _new_tag()
    writer.write(_peer_message(recv_tag))
    await writer.drain()
    return await _endpoint(address, send_tag, recv_tag)


def _new_tag() -> int:
    return int.from_bytes(os.urandom(8), "little")


def _peer_message(recv_tag: int) -> bytes:
    """This worker's UCX address and the tag the peer must send under."""
    address = bytes(ucxx.get_worker_address().tobytes())
    return _PEER.pack(recv_tag, len(address)) + address


async def _read_peer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    tag, length = _PEER.unpack(await reader.readexactly(_PEER.size))
    if length > _MAX_ADDRESS_BYTES:
        raise KVTransferError(f"a UCX worker address of {length} bytes: the peer does not speak this protocol")
    return tag, await reader.readexactly(length)


async def _endpoint(address: bytes, send_tag: int, recv_tag: int) -> Any:
    ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address))
    # The per-connection tags that a ucxx listener would agree on over the endpoint itself;
    # here they came over the TCP link. Sends and receives hash their tag with these.
    ep._tags = {"msg_send": send_tag, "msg_recv": recv_tag}
    return ep
