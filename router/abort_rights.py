"""Who may abort a request by its id (the router's `Abort`).

Every client of a router shares one API key, so the key says nothing about which client
started a request. Rule, set when the request's id is made:
  1. The client left `request_id` empty: the router makes a 128-bit random id, which only
     that request's own stream learns. Holding it is the proof: any caller with the API
     key and the id may abort it (e.g. another process the client handed the id to).
  2. The client chose the id (guessable: "req-1"): only a call on the same gRPC
     connection (the peer address of its live TCP connection, which no other client can
     share) may abort it. The Client library aborts over the connection it streams on.
  3. Anything else (another connection, an id not in flight) is answered "not found": a
     caller learns nothing about other clients' requests.
What shares a connection counts as one caller under rule 2: gRPC pools one process's
channels to a router onto one connection, and a proxy may pool many clients onto one;
behind such a proxy, leave `request_id` empty.

An id is claimed when its request is built and forgotten when its call ends. A second
request under an id still claimed keeps no rights (its Generate is refused as a duplicate).
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class _Starter:
    connection: str  # the gRPC peer ("ipv4:127.0.0.1:51234") of the call that started it; "": unknown
    id_is_secret: bool  # the router made the id: unguessable, known only to whoever was told


class AbortRights:
    def __init__(self) -> None:
        self._starters: dict[str, _Starter] = {}
        self._lock = threading.Lock()

    def claim(self, client_request_id: str, context: grpc.ServicerContext) -> str:
        """The id of a request `context` starts (the client's, else a fresh random one),
        recorded with who may abort it until the call ends."""
        request_id = client_request_id or secrets.token_hex(16)
        starter = _Starter(connection_of(context), id_is_secret=not client_request_id)
        with self._lock:
            if request_id in self._starters:
                return request_id  # claimed by a request in flight: that one keeps it
            self._starters[request_id] = starter
        if not context.add_callback(lambda: self._forget(request_id, starter)):
            self._forget(request_id, starter)  # the call has already ended
        return request_id

    def may_abort(self, request_id: str, context: grpc.ServicerContext) -> bool:
        with self._lock:
            starter = self._starters.get(request_id)
        if starter is None:
            return False
        return starter.id_is_secret or (starter.connection != "" and starter.connection == connection_of(context))

    def _forget(self, request_id: str, starter: _Starter) -> None:
        with self._lock:
            if self._starters.get(request_id) is starter:
                del self._starters[request_id]


def connection_of(context: grpc.ServicerContext) -> str:
    """The caller's TCP connection ("ipv4:host:port", "ipv6:[host]:port"); "" for any other
    transport, whose peer string need not tell two clients apart."""
    peer = str(context.peer())
    return peer if peer.startswith(("ipv4:", "ipv6:")) else ""
