"""Worker logs join the host's log stream: a Unix-socket relay, framed and bounded per Worker.

Why a socket the Worker connects to (rather than a pipe handed down at fork): Workers are forked
by the forkserver, which was started before any per-Worker file existed, so the host cannot hand
a fresh pipe to each child without changing the forkserver protocol. Instead the host listens on
a Unix socket in a private (0700) directory and passes its path in the Worker's settings; the
Worker connects three streams as its first action (:func:`attach`):

- ``records``: one JSON line per stdlib ``logging`` record at or above the host's level (the
  Worker's root logger gets a handler that writes here), plus one ``exc`` line when the processor
  raised: exception type, frames (file, line, function) and the redacted, length-capped
  message, unless the Family opted out with ``log_exception_messages=False`` (for processors
  whose messages may quote Source text);
- ``stdout`` / ``stderr``: file descriptors 1 and 2 are redirected here, so ``print``, stray
  writes and a subprocess's output arrive line by line.

The host reads every connection on one daemon thread (:class:`WorkerLogRelay`), never on the
scheduling loop, and re-emits each line as a host log record carrying ``family``, ``binding``,
``scope``, ``worker_id``, ``term`` and ``request_generation``; the host's formatter applies the
usual redaction. Lines are cut at ``max_line`` bytes and each Worker gets a token bucket of
``rate`` lines per second (``burst`` at once): excess lines are read and dropped, so a chatty
processor never blocks on a full socket and never floods the host; the number dropped is
logged once when the Worker's streams close. Without the relay (no socket path in the
environment) :func:`attach` does nothing and a Worker behaves as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from apsup.observability.tracing import current_ids

SOCKET_ENV = "APSUP_WORKER_LOG_SOCKET"
LEVEL_ENV = "APSUP_WORKER_LOG_LEVEL"
MAX_LINE = 8192
MAX_FRAMES = 40
RATE = 200.0
BURST = 1000.0

log = logging.getLogger("apsup.worker")

# --- Worker side --------------------------------------------------------------------------------

_records: socket.socket | None = None
_records_lock = threading.Lock()
_include_messages = True


def exception_frames(exc: BaseException, limit: int = MAX_FRAMES) -> list[dict[str, Any]]:
    """The innermost ``limit`` frames of ``exc``'s traceback as file/line/function dicts."""
    frames = traceback.extract_tb(exc.__traceback__)[-limit:]
    return [{"file": f.filename, "line": f.lineno, "function": f.name} for f in frames]


def exception_type(exc: BaseException) -> str:
    """The class name as written (``RuntimeError``, ``mypkg.errors.SourceGone``)."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def describe_exception(exc: BaseException, *, include_message: bool) -> dict[str, Any]:
    """Type and frames, plus the redacted, truncated message only when asked for."""
    from apsup.observability.logging import exception_message

    out: dict[str, Any] = {"exception_type": exception_type(exc), "frames": exception_frames(exc)}
    if include_message:
        out["error"] = exception_message(exc)
    return out


def _send(doc: dict[str, Any]) -> None:
    sock = _records
    if sock is None:
        return
    line = orjson.dumps(doc, default=str)[: MAX_LINE - 1] + b"\n"
    with contextlib.suppress(Exception), _records_lock:
        sock.sendall(line)


class _ChannelHandler(logging.Handler):
    """Sends each record as one JSON line on the ``records`` stream; never raises."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            try:
                msg = record.getMessage()
            except Exception:
                msg = f"{record.msg!s} <message formatting failed>"
            doc: dict[str, Any] = {
                "t": "log",
                "level": record.levelno,
                "logger": record.name,
                "msg": msg[:MAX_LINE],
                "created": record.created,
            }
            doc.update(current_ids())
            if record.exc_info and record.exc_info[1] is not None:
                doc["exc"] = describe_exception(
                    record.exc_info[1], include_message=_include_messages
                )
            _send(doc)
        except Exception:
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _connect(path: str, header: dict[str, Any]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(orjson.dumps(header) + b"\n")
    return sock


def attach(ctx: Any, *, include_messages: bool = True, streams: tuple[int, ...] = ()) -> bool:
    """Connect this Worker to the host's relay (``ctx`` is its ExecutionContext).

    ``streams``: the records, stdout and stderr sockets the host passed with the launch
    (:meth:`WorkerLogRelay.open_streams`), already tied to this invocation on the host's side;
    without them the Worker connects three streams to the relay's socket itself. Returns False
    (and changes nothing) when no relay is configured or it cannot be reached.
    """
    if _records is not None:
        return False
    if len(streams) == 3:
        records = socket.socket(fileno=streams[0])
        for fd, stream_fd in ((1, streams[1]), (2, streams[2])):
            os.dup2(stream_fd, fd)  # inheritable copy: subprocess output is relayed too
            os.close(stream_fd)
        return _attached(records, include_messages)
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return False
    base = {
        "worker_id": ctx.worker_id,
        "family": ctx.artifact_family,
        "binding": ctx.binding_name,
        "scope": ctx.scope_id,
        "term": ctx.supervisor_generation,
        "request_generation": ctx.claimed_request_generation,
    }
    try:
        records = _connect(path, {**base, "stream": "records"})
        for fd, name in ((1, "stdout"), (2, "stderr")):
            sock = _connect(path, {**base, "stream": name})
            os.dup2(sock.fileno(), fd)  # inheritable copy: subprocess output is framed too
            sock.close()
    except OSError:
        return False
    return _attached(records, include_messages)


def _attached(records: socket.socket, include_messages: bool) -> bool:
    """Records go to ``records``, logging to a handler writing there, stdio line-buffered."""
    global _records, _include_messages
    _records = records
    _include_messages = include_messages
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(_ChannelHandler())
    try:
        root.setLevel(int(os.environ.get(LEVEL_ENV, logging.INFO)))
    except ValueError:
        root.setLevel(logging.INFO)
    return True


def set_include_messages(include: bool) -> None:
    """The Family decides (``log_exception_messages``) once it is resolved."""
    global _include_messages
    _include_messages = include


def report_exception(exc: BaseException) -> None:
    """Tell the host why the processor failed: type and frames (message only if opted in)."""
    _send({"t": "exc", **describe_exception(exc, include_message=_include_messages)})


# --- host side ----------------------------------------------------------------------------------

_STREAM_LEVEL = {"stdout": logging.INFO, "stderr": logging.WARNING}
#: The invocation's fields every relayed line carries.
_FIELDS = ("family", "binding", "scope", "worker_id", "term", "request_generation")


@dataclass
class _Worker:
    fields: dict[str, Any]
    tokens: float
    stamp: float
    dropped: int = 0
    streams: int = 0
    records_closed: bool = False


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)
    skipping: bool = False  # the current line exceeded max_line: drop until its newline
    stream: str | None = None
    worker: _Worker | None = None


class WorkerLogRelay:
    """Host end of the Worker log streams: one listening socket, one reader thread."""

    def __init__(
        self,
        level: int | None = None,
        *,
        max_line: int = MAX_LINE,
        rate: float = RATE,
        burst: float = BURST,
        exception_timeout: float = 0.5,
    ) -> None:
        self.level = logging.getLogger().getEffectiveLevel() if level is None else level
        self.max_line = max_line
        self.rate = rate
        self.burst = burst
        self.exception_timeout = exception_timeout
        self._dir = tempfile.mkdtemp(prefix="apsup-logs-")  # 0700: only this user connects
        self.path = os.path.join(self._dir, "w.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._workers: dict[str, _Worker] = {}
        self._cond = threading.Condition()
        self._exceptions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._closed_records: OrderedDict[str, None] = OrderedDict()
        self._stop = False
        #: Streams Workers connected themselves (the fallback when none came with the launch).
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name="apsup-worker-logs", daemon=True)
        self._thread.start()

    def open_streams(self, fields: dict[str, Any]) -> tuple[int, ...]:
        """Three connected socket pairs for one Worker: records, stdout, stderr.

        The host's ends join the reader thread tied to the invocation's ``fields``; the
        Worker's ends are returned, to travel with its launch (``WorkerPool.submit(fds=...)``,
        ``attach(streams=...)``), and the caller closes them once sent. Why: a Worker that
        connects its three streams itself (socket, connect, a JSON header each) and a relay
        that accepts them cost CPU in the Worker and more in the host, per invocation. Empty once
        the relay is closed (the Worker then connects, or logs nowhere).
        """
        if self._stop:
            return ()
        wid = str(fields.get("worker_id"))
        worker = _Worker(
            {key: fields.get(key) for key in _FIELDS}, self.burst, time.monotonic(), streams=3
        )
        worker_ends: list[int] = []
        conns: list[_Conn] = []
        try:
            for name in ("records", "stdout", "stderr"):
                host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                host_end.setblocking(False)
                conns.append(_Conn(host_end, stream=name, worker=worker))
                worker_ends.append(worker_end.detach())
        except OSError:
            for conn in conns:
                conn.sock.close()
            for fd in worker_ends:
                os.close(fd)
            return ()
        self._workers[wid] = worker
        for conn in conns:  # epoll takes it while the reader thread waits
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
        return tuple(worker_ends)

    def env(self) -> dict[str, str]:
        """Variables for the Workers' settings (the path is not a secret; the dir is 0700)."""
        return {SOCKET_ENV: self.path, LEVEL_ENV: str(self.level)}

    # -- results for the scheduling loop ---------------------------------------------------------

    def take_exception(self, worker_id: str, timeout: float | None = None) -> dict[str, Any]:
        """The exception a (confirmed-exited) Worker reported, or ``{}``.

        Its process is gone, so everything it wrote is already in the socket buffers; wait only
        for the reader thread to reach it (bounded by ``timeout``).
        """
        wait = self.exception_timeout if timeout is None else timeout
        with self._cond:
            self._cond.wait_for(
                lambda: worker_id in self._exceptions or worker_id in self._closed_records,
                timeout=wait,
            )
            self._closed_records.pop(worker_id, None)
            return self._exceptions.pop(worker_id, {})

    def forget(self, worker_id: str) -> None:
        with self._cond:
            self._closed_records.pop(worker_id, None)
            self._exceptions.pop(worker_id, None)

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(Exception):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        with contextlib.suppress(OSError):
            self._wake_w.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- reader thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            try:
                events = self._sel.select(timeout=1.0)
            except OSError:  # pragma: no cover - selector closed under us
                return
            for key, _ in events:
                try:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        self._read(key.data)
                except Exception:  # never let one bad stream stop the relay
                    log.debug("worker log relay step failed", exc_info=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self.accepted += 1
            sock.setblocking(False)
            self._sel.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if conn.buf and not conn.skipping:
                self._line(conn, bytes(conn.buf))
            self._close(conn)
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            piece = chunk[start:nl]
            if conn.skipping:
                conn.skipping = False
            else:
                conn.buf += piece
                self._line(conn, bytes(conn.buf[: self.max_line]))
            conn.buf.clear()
            start = nl + 1
        if not conn.skipping:
            conn.buf += chunk[start:]
            if len(conn.buf) > self.max_line:  # an endless line: emit its head, drop the rest
                self._line(conn, bytes(conn.buf[: self.max_line]))
                conn.buf.clear()
                conn.skipping = True

    def _close(self, conn: _Conn) -> None:
        with contextlib.suppress(Exception):
            self._sel.unregister(conn.sock)
        conn.sock.close()
        w = conn.worker
        if w is None:
            return
        w.streams -= 1
        wid = str(w.fields.get("worker_id"))
        if conn.stream == "records":
            with self._cond:
                self._closed_records[wid] = None
                while len(self._closed_records) > 1024:
                    self._closed_records.popitem(last=False)
                self._cond.notify_all()
        if w.streams <= 0:
            self._workers.pop(wid, None)
            if w.dropped:
                log.warning(
                    "worker log lines dropped (rate limit)",
                    extra={"apsup_fields": {**w.fields, "dropped": w.dropped}},
                )

    def _header(self, conn: _Conn, line: bytes) -> None:
        doc = orjson.loads(line)
        if not isinstance(doc, dict) or "worker_id" not in doc:
            raise ValueError("bad worker log header")
        conn.stream = str(doc.pop("stream", "stdout"))
        wid = str(doc["worker_id"])
        w = self._workers.get(wid)
        if w is None:
            fields = {k: doc.get(k) for k in _FIELDS}
            w = self._workers[wid] = _Worker(fields, self.burst, time.monotonic())
        w.streams += 1
        conn.worker = w

    def _allow(self, w: _Worker) -> bool:
        now = time.monotonic()
        w.tokens = min(self.burst, w.tokens + (now - w.stamp) * self.rate)
        w.stamp = now
        if w.tokens < 1.0:
            w.dropped += 1
            return False
        w.tokens -= 1.0
        return True

    def _line(self, conn: _Conn, raw: bytes) -> None:
        if conn.worker is None:
            self._header(conn, raw)
            return
        w = conn.worker
        if conn.stream == "records":
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                doc = {"t": "log", "level": logging.WARNING, "msg": raw.decode("utf-8", "replace")}
            if not isinstance(doc, dict):
                return
            if doc.get("t") == "exc":
                doc.pop("t", None)
                with self._cond:
                    self._exceptions[str(w.fields["worker_id"])] = doc
                    while len(self._exceptions) > 1024:
                        self._exceptions.popitem(last=False)
                    self._cond.notify_all()
                return
            self._emit_record(w, doc)
            return
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if not text.strip():
            return
        level = _STREAM_LEVEL.get(conn.stream or "", logging.INFO)
        if log.isEnabledFor(level) and self._allow(w):
            self._emit(w, level, "apsup.worker." + str(conn.stream), text, {"stream": conn.stream})

    def _emit_record(self, w: _Worker, doc: dict[str, Any]) -> None:
        try:
            level = int(doc.get("level", logging.INFO))
        except (TypeError, ValueError):
            level = logging.INFO
        if level < self.level or not self._allow(w):
            return
        extra: dict[str, Any] = {}
        exc = doc.get("exc")
        if isinstance(exc, dict):
            extra.update(exc)
        for key in ("trace_id", "span_id"):
            if isinstance(doc.get(key), str):
                extra[key] = doc[key]
        name = str(doc.get("logger") or "worker")
        created = doc.get("created")
        self._emit(w, level, name, str(doc.get("msg", "")), extra, created)

    def _emit(
        self,
        w: _Worker,
        level: int,
        name: str,
        msg: str,
        extra: dict[str, Any],
        created: Any = None,
    ) -> None:
        record = log.makeRecord(
            name, level, "(worker)", 0, msg, (), None, extra={"apsup_fields": {**w.fields, **extra}}
        )
        if isinstance(created, int | float):
            record.created = float(created)
        log.handle(record)


__all__ = [
    "LEVEL_ENV",
    "SOCKET_ENV",
    "WorkerLogRelay",
    "attach",
    "describe_exception",
    "exception_frames",
    "exception_type",
    "report_exception",
    "set_include_messages",
]
