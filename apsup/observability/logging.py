"""Structured logging with redaction on every record (RFC §12).

Logs must never carry credentials, full database connection strings, Source bodies, Prompts or
model outputs. apsup cannot know every secret a processor touches, so redaction is layered and
applied by the formatters to *everything* they emit (message after ``%`` args, every ``extra``
field, exception messages and tracebacks, stack info):

1. registered secrets (``register_secret``/``register_dsn``: the DB password and the full DSN
   are registered at startup) are replaced by ``***``, including their URL-quoted forms;
2. URL userinfo passwords: ``scheme://user:pass@host`` -> ``scheme://user:***@host``;
3. ``password=...``/``pwd=``/``secret=``/``token=``/``api_key=`` style pairs (also ``key: value``
   and quoted JSON/repr forms) and ``Bearer <token>``;
4. structured fields whose *name* looks sensitive (``password``, ``db_secret``, ...) -> ``***``.

Exception messages are redacted, then truncated to ``max_exception_message`` (200) characters:
a processor's exception text may quote its input. **Processors must not put Source bodies,
Prompts or model output in exception messages**; truncation is a last line of defence, not a
licence. Scheduling failure logs carry ``exception_type`` and the redacted, truncated ``error``
(``exception_fields``), never a traceback of the Worker's data; a Worker's failure record has
its exception type and frames (file, line, function) and its message only if the Family opted
in (``apsup.observability.worker_logs``).

Scheduling failure log fields (``FAILURE_FIELDS``; RFC §12): binding, family, scope, trigger
(admission reason: interval | cron | request | retry | recovery), request_generation, worker_id,
term (supervisor generation), stage (launch | run | exit | acknowledge | discovery | ...),
error_code (exit code/signal or DB error code), exception_type, error, retry_count, retry_delay.

Startup (``log_startup``) logs one ``startup`` event: mode, role, bindings and Families with
their effective schedule, budget and timeout, the candidate terms per supervisor key, and the
compatibility aliases in use; the DSN is logged only through ``safe_url`` (password masked).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import IO, Any, Literal, Protocol

import orjson

from apsup.observability.tracing import current_ids

MASK = "***"
MAX_EXCEPTION_MESSAGE = 200

FAILURE_FIELDS = (
    "binding",
    "family",
    "scope",
    "trigger",
    "request_generation",
    "worker_id",
    "term",
    "stage",
    "error_code",
    "exception_type",
    "error",
    "retry_count",
    "retry_delay",
)

# --- redaction ---------------------------------------------------------------------------------

_SENSITIVE = r"(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|credentials?)"
_SENSITIVE_NAME = re.compile(rf"(?i){_SENSITIVE}|^(?:dsn|database_url|db_url)$")
_URL_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][\w+.\-]*://[^:/?#@\s'\"<>]*):[^\s'\"<>]*@")
_PAIR = re.compile(
    rf"""(?ix)
    (?P<key>\b[\w.\-]*{_SENSITIVE}[\w\-]*)   # password, db_password, PGPASSWORD, api-key, ...
    (?P<q>["']?)                             # closing quote of a quoted key
    (?P<sep>\s*[=:]\s*)
    (?P<val>"[^"]*"|'[^']*'|[^\s"',;&)}}\]]+)
    """
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/\-]+=*")
#: Prose: "password hunter2", "token is abc123" (no ``=`` or ``:``). The word after the key is
#: masked unless it is plainly prose ("password authentication failed"): over-masking a word
#: is the safe failure, a stop list only keeps common messages readable.
_PROSE = re.compile(
    rf"""(?ix)
    (?P<key>\b[\w.\-]*{_SENSITIVE}[\w\-]*)
    (?P<sep>\s+(?:(?:is|was|of|equals)\s+)?)
    (?P<val>[^\s"',;&)}}\]=:]+)
    """
)
_PROSE_WORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "and",
        "or",
        "for",
        "to",
        "in",
        "on",
        "at",
        "by",
        "with",
        "from",
        "not",
        "no",
        "is",
        "was",
        "are",
        "be",
        "been",
        "has",
        "have",
        "had",
        "must",
        "may",
        "can",
        "cannot",
        "could",
        "should",
        "will",
        "would",
        "did",
        "does",
        "do",
        "authentication",
        "auth",
        "incorrect",
        "wrong",
        "invalid",
        "expired",
        "missing",
        "required",
        "rejected",
        "refused",
        "denied",
        "failed",
        "failure",
        "error",
        "mismatch",
        "set",
        "unset",
        "empty",
        "given",
        "provided",
        "field",
        "fields",
        "policy",
        "reset",
        "change",
        "changed",
        "length",
        "too",
        "hash",
        "hashes",
        "file",
        "files",
        "value",
        "values",
    ]
)

_secrets_lock = threading.Lock()
_secrets: set[str] = set()
_secret_re: re.Pattern[str] | None = None


def register_secret(value: str | None) -> None:
    """Redact ``value`` (and its URL-quoted forms) from every log record from now on.

    Empty values are ignored. A very short secret will mask every occurrence of those
    characters: over-redaction is the safe failure.
    """
    global _secret_re
    if not value:
        return
    forms = {value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value)}
    with _secrets_lock:
        _secrets.update(forms)
        ordered = sorted(_secrets, key=len, reverse=True)  # longest first: the DSN before its pw
        _secret_re = re.compile("|".join(re.escape(s) for s in ordered))


def register_dsn(url: str | None) -> None:
    """Register a database URL: the full string and its (decoded and raw) password."""
    if not url:
        return
    register_secret(url)
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return
    if password:
        register_secret(password)
        register_secret(urllib.parse.unquote(password))


def clear_secrets() -> None:
    """Forget registered secrets (tests; a process that rotates credentials re-registers)."""
    global _secret_re
    with _secrets_lock:
        _secrets.clear()
        _secret_re = None


def _mask_pair(m: re.Match[str]) -> str:
    val = m.group("val")
    masked = f"{val[0]}{MASK}{val[0]}" if val[:1] in ("'", '"') else MASK
    return f"{m.group('key')}{m.group('q')}{m.group('sep')}{masked}"


def redact(text: str) -> str:
    """Remove registered secrets, URL passwords, sensitive ``key=value`` pairs, bearer tokens."""
    pattern = _secret_re
    if pattern is not None:
        text = pattern.sub(MASK, text)
    text = _URL_USERINFO.sub(rf"\g<head>:{MASK}@", text)
    text = _PAIR.sub(_mask_pair, text)
    text = _BEARER.sub(rf"\g<1>{MASK}", text)
    return _PROSE.sub(_mask_prose, text)


def _mask_prose(m: re.Match[str]) -> str:
    val = m.group("val")
    if val == MASK or val.lower() in _PROSE_WORDS:
        return m.group(0)
    return f"{m.group('key')}{m.group('sep')}{MASK}"


def safe_url(url: str) -> str:
    """A DSN fit for a log line: password masked, query string dropped."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return MASK
    head = url.split("?", 1)[0].split("#", 1)[0]  # urlunsplit would mangle sqlite:////abs
    if parts.password is None:
        return head
    userinfo, _, hostport = parts.netloc.rpartition("@")
    return head.replace(parts.netloc, f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}", 1)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def exception_message(exc: BaseException, limit: int = MAX_EXCEPTION_MESSAGE) -> str:
    """Redacted, whitespace-collapsed, truncated ``str(exc)``; redaction runs before the cut."""
    try:
        text = str(exc)
    except Exception:
        text = "<unprintable>"
    return _clip(redact(text), limit)


def exception_fields(exc: BaseException, limit: int = MAX_EXCEPTION_MESSAGE) -> dict[str, str]:
    """``exception_type`` and ``error`` for a failure log; never the full message or traceback."""
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
    return {"exception_type": name, "error": exception_message(exc, limit)}


def error_fields(exc: BaseException, limit: int = MAX_EXCEPTION_MESSAGE) -> dict[str, str]:
    """The fields every failure log record carries: ``exception_type`` (the class name) and
    ``error`` (its redacted, length-capped message), so a log says why, not only what."""
    return {"exception_type": type(exc).__name__, "error": exception_message(exc, limit)}


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def format_exception(exc: BaseException, limit: int = MAX_EXCEPTION_MESSAGE) -> str:
    """A traceback like the stdlib's, with each chained exception's message redacted+truncated."""
    # chain[i + 1] is the cause/context of chain[i]; links[i] says which one it is
    chain: list[BaseException] = []
    links: list[str] = []
    cur: BaseException | None = exc
    while cur is not None and not any(cur is e for e in chain):
        chain.append(cur)
        if cur.__cause__ is not None:
            cur = cur.__cause__
            links.append(_CAUSE)
        elif cur.__context__ is not None and not cur.__suppress_context__:
            cur = cur.__context__
            links.append(_CONTEXT)
        else:
            cur = None
    parts: list[str] = []
    for i in range(len(chain) - 1, -1, -1):  # oldest first, like the stdlib
        e = chain[i]
        if e.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n")
            parts.extend(traceback.extract_tb(e.__traceback__).format())
        fields = exception_fields(e, limit)
        parts.append(f"{fields['exception_type']}: {fields['error']}\n")
        if i > 0:
            parts.append(links[i - 1])
    return redact("".join(parts).rstrip("\n"))


# --- formatters --------------------------------------------------------------------------------

_RECORD_ATTRS = frozenset(
    set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__)
    | {"message", "asctime", "taskName", "event", "apsup_fields"}
)


def _clean(value: Any, depth: int = 0) -> Any:
    """JSON-safe copy of a structured value with every string redacted."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, BaseException):
        return exception_message(value)
    if depth < 4 and isinstance(value, Mapping):
        return {
            str(k): MASK if _SENSITIVE_NAME.search(str(k)) else _clean(v, depth + 1)
            for k, v in value.items()
        }
    if depth < 4 and isinstance(value, list | tuple | set | frozenset):
        return [_clean(v, depth + 1) for v in value]
    try:
        return redact(str(value))
    except Exception:
        return "<unprintable>"


class _Base(logging.Formatter):
    def __init__(self, max_exception_message: int = MAX_EXCEPTION_MESSAGE) -> None:
        super().__init__()
        self.max_exception_message = max_exception_message

    def _fields(self, record: logging.LogRecord) -> dict[str, Any]:
        raw: dict[str, Any] = {
            k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS and k[:1] != "_"
        }
        raw.update(getattr(record, "apsup_fields", None) or {})
        cleaned = _clean(raw)
        return cleaned if isinstance(cleaned, dict) else {}

    def _message(self, record: logging.LogRecord) -> str:
        try:
            msg = record.getMessage()
        except Exception:  # bad %-args: keep the template, never the raw args
            msg = f"{record.msg!s} <message formatting failed>"
        return redact(msg)

    def _exc(self, record: logging.LogRecord) -> str | None:
        if record.exc_info and record.exc_info[1] is not None:
            return format_exception(record.exc_info[1], self.max_exception_message)
        if record.exc_text:  # formatted elsewhere (another handler); redact what we have
            return redact(record.exc_text)
        return None

    def formatException(self, ei: Any) -> str:
        exc = ei[1] if isinstance(ei, tuple) else None
        if exc is None:
            return ""
        return format_exception(exc, self.max_exception_message)


class JsonFormatter(_Base):
    """One JSON object per line: ts, level, logger, msg, event?, fields..., exc?, stack?."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            doc: dict[str, Any] = {
                "ts": datetime.fromtimestamp(record.created, UTC).isoformat(
                    timespec="milliseconds"
                ),
                "level": record.levelname,
                "logger": record.name,
                "msg": self._message(record),
            }
            event = getattr(record, "event", None)
            if event is not None:
                doc["event"] = redact(str(event))
            for k, v in self._fields(record).items():
                doc.setdefault(k, v)
            for k, v in current_ids().items():  # only when opentelemetry is in use
                doc.setdefault(k, v)
            exc = self._exc(record)
            if exc:
                doc["exc"] = exc
            if record.stack_info:
                doc["stack"] = redact(record.stack_info)
            return orjson.dumps(doc, default=str).decode()
        except Exception as err:  # a log line must never raise into the caller
            return orjson.dumps(
                {
                    "level": "ERROR",
                    "logger": __name__,
                    "msg": f"unformattable record: {err!r}"[:200],
                }
            ).decode()


class HumanFormatter(_Base):
    """``HH:MM:SS.mmm LEVEL logger: msg key=value ...`` for a terminal; the same redaction."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
            line = f"{ts} {record.levelname:<7} {record.name}: {self._message(record)}"
            event = getattr(record, "event", None)
            if event is not None and event != record.msg:
                line += f" event={event}"
            fields = " ".join(f"{k}={v}" for k, v in self._fields(record).items())
            if fields:
                line += " " + fields
            exc = self._exc(record)
            if exc:
                line += "\n" + exc
            if record.stack_info:
                line += "\n" + record.stack_info
            return redact(line)
        except Exception as err:
            return f"unformattable log record: {err!r}"[:200]


LogFormat = Literal["json", "human", "auto"]

_HANDLER_MARK = "_apsup_handler"


def configure_logging(
    fmt: LogFormat = "auto",
    level: int | str = logging.INFO,
    stream: IO[str] | None = None,
    *,
    max_exception_message: int = MAX_EXCEPTION_MESSAGE,
) -> logging.Handler:
    """Install one redacting handler on the root logger (replacing a previous apsup handler).

    ``auto`` picks ``human`` when ``stream`` is a TTY, JSON lines otherwise (services, files).
    """
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        try:
            fmt = "human" if out.isatty() else "json"
        except Exception:
            fmt = "json"
    formatter: logging.Formatter = (
        HumanFormatter(max_exception_message)
        if fmt == "human"
        else JsonFormatter(max_exception_message)
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
            old.close()
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def log_event(
    logger: logging.Logger,
    event: str,
    /,
    *,
    level: int = logging.INFO,
    exc: BaseException | None = None,
    **fields: Any,
) -> None:
    """Log ``event`` with structured ``fields``; ``exc`` adds ``exception_fields`` only.

    Fields travel in one record attribute, so any name (even ``name`` or ``process``) is safe.
    Never raises: logging must not break scheduling.
    """
    try:
        if not logger.isEnabledFor(level):
            return
        if exc is not None:
            fields.update(exception_fields(exc))
        logger.log(level, event, extra={"event": event, "apsup_fields": fields})
    except Exception:
        pass


class _FamilyLike(Protocol):
    """Read-only view of ``apsup.registry.Family`` (a frozen dataclass)."""

    @property
    def name(self) -> str: ...
    @property
    def binding_name(self) -> str: ...
    @property
    def max_workers(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def policy(self) -> Any: ...


def log_startup(
    logger: logging.Logger,
    *,
    mode: str,
    role: str,
    families: Iterable[_FamilyLike],
    terms: Mapping[str, int] | None = None,
    aliases: Iterable[str] = (),
    database_url: str | None = None,
) -> None:
    """The RFC §12 startup record; the DSN appears only via ``safe_url``."""
    described = []
    for fam in families:
        policy = fam.policy
        schedule = policy.describe() if hasattr(policy, "describe") else str(policy)
        described.append(
            {
                "family": fam.name,
                "binding": fam.binding_name,
                "schedule": schedule,
                "max_workers": fam.max_workers,
                "timeout": fam.timeout,
            }
        )
    log_event(
        logger,
        "startup",
        mode=mode,
        role=role,
        families=described,
        terms=dict(terms or {}),
        aliases=list(aliases),
        database=safe_url(database_url) if database_url else None,
    )
