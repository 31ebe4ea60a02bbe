"""A TCP fault proxy between hosts and the MySQL-compatible test server.

Hosts connect to ``proxy.port`` on 127.0.0.1; the proxy forwards to the real server unless told
otherwise, on command, from the test process:

- ``drop()``: reset every open connection now (RST both ways); new connections still work.
- ``blackhole()``: a half-open network: every open connection stops forwarding for good (its
  client waits for a reply that never comes, as when the server vanished without FIN or RST),
  and new connections are accepted but never forwarded. ``heal()`` lets new connections through
  again; the black-holed ones stay dead until their client gives up on them.
- ``latency(seconds)``: delay every forwarded chunk by that much.

Threads, one pair per connection: the proxy carries a handful of pooled connections.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.engine import make_url


@dataclass(eq=False)
class _Link:
    client: socket.socket
    upstream: socket.socket | None
    dead: bool = False  # black-holed: never forwards again
    closed: threading.Event = field(default_factory=threading.Event)

    def close(self, reset: bool = False) -> None:
        self.closed.set()
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if reset:  # SO_LINGER 0: close sends RST, as a crashed peer or a firewall would
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.close()


class FaultProxy:
    """Forward 127.0.0.1:``port`` to ``upstream`` with injectable faults (see module doc)."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._holes = False
        self._latency = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        #: Counts of faults injected, for the campaign's report.
        self.counts = {"drop": 0, "blackhole": 0, "latency": 0, "connections": 0}

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        u = make_url(url)
        return cls(u.host or "127.0.0.1", int(u.port or 3306))

    def url(self, url: str) -> str:
        """``url`` pointed at the proxy instead of the server."""
        return (
            make_url(url)
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=5)
        self.drop(count=False)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults ---------------------------------------------------------------------------------
    def drop(self, *, count: bool = True) -> int:
        """Reset every open connection; returns how many."""
        with self._lock:
            links, self._links = list(self._links), set()
        for link in links:
            link.close(reset=True)
        if count:
            self.counts["drop"] += 1
        return len(links)

    def blackhole(self) -> None:
        with self._lock:
            self._holes = True
            for link in self._links:
                link.dead = True
        self.counts["blackhole"] += 1

    def heal(self) -> None:
        """New connections forward again; latency back to zero."""
        with self._lock:
            self._holes = False
            self._latency = 0.0

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latency = max(0.0, seconds)
        if seconds > 0:
            self.counts["latency"] += 1

    @property
    def open_links(self) -> int:
        with self._lock:
            return len(self._links)

    # -- forwarding -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.counts["connections"] += 1
            with self._lock:
                holes = self._holes
            upstream = None
            if not holes:
                try:
                    upstream = socket.create_connection(self.upstream, timeout=5)
                except OSError:
                    client.close()
                    continue
            link = _Link(client, upstream, dead=holes)
            with self._lock:
                self._links.add(link)
            pairs = [(client, upstream), (upstream, client)] if upstream else [(client, client)]
            for src, dst in pairs:  # without upstream: read and swallow, never answer
                threading.Thread(
                    target=self._pump, args=(link, src, dst), name="fault-proxy-pump", daemon=True
                ).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not link.closed.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break  # that side closed (a client giving up on a black hole, too)
                if link.dead:
                    continue  # black-holed: swallowed, the peer's reads block until it gives up
                with self._lock:
                    delay = self._latency
                if delay:
                    time.sleep(delay)
                if link.dead:
                    continue  # swallowed by the black hole
                dst.sendall(data)
        except OSError:
            pass
        with self._lock:
            self._links.discard(link)
        link.close()
