"""Logs never carry credentials, full DSNs or Source bodies, whatever path a secret takes (RFC §12).

Every path a string can reach a log line through is fed a secret: the message, %-args, ``extra``
fields (plain and nested), exception messages and chained tracebacks raised from a "processor",
``log_event(..., exc=)``, ``key=value`` pairs and a registered secret; in both formats.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator

import orjson
import pytest

from apsup import Registry, family
from apsup.observability.logging import (
    FAILURE_FIELDS,
    MAX_EXCEPTION_MESSAGE,
    HumanFormatter,
    JsonFormatter,
    clear_secrets,
    configure_logging,
    exception_fields,
    log_event,
    log_startup,
    redact,
    register_dsn,
    register_secret,
    safe_url,
)

DB_PASSWORD = "S3cr3t-Pw!x"
DSN = "mysql+pymysql://apsup:S3cr3t-Pw%21x@db.internal:3306/apsup"
REGISTERED = "tok-REGISTERED-777"
URL_PASSWORD = "urlpass-9Q"  # never registered: only the URL rule can catch it
PAIRS = {
    "password": "pairpw-1",
    "pwd": "pairpw-2",
    "secret": "pairpw-3",
    "token": "pairpw-4",
    "api_key": "pairpw-5",
}
SOURCE_MARKER = "SOURCE-BODY-TAIL-MARKER"
SECRETS = [DB_PASSWORD, "S3cr3t-Pw%21x", DSN, REGISTERED, URL_PASSWORD, *PAIRS.values()]


class ProcessorError(Exception):
    pass


def processor(scope_id: str) -> None:
    """A processor that leaks everything it can into its exception message."""
    body = "lorem ipsum " * 500 + SOURCE_MARKER
    try:
        raise ConnectionError(f"cannot reach {DSN} (pwd={PAIRS['pwd']})")
    except ConnectionError as exc:
        raise ProcessorError(
            f"scope {scope_id}: http://svc:{URL_PASSWORD}@api.local/x token={PAIRS['token']} "
            f"{REGISTERED} body={body}"
        ) from exc


@pytest.fixture
def configure() -> Iterator[Callable[[str], io.StringIO]]:
    """Install the apsup handler on a fresh StringIO per call; restore the root logger after."""
    root = logging.getLogger()
    level = root.level
    clear_secrets()
    register_dsn(DSN)
    register_secret(REGISTERED)
    installed: list[logging.Handler] = []

    def _configure(fmt: str) -> io.StringIO:
        stream = io.StringIO()
        installed.append(configure_logging(fmt, stream=stream))  # type: ignore[arg-type]
        return stream

    yield _configure
    for handler in installed:
        root.removeHandler(handler)
    root.setLevel(level)
    clear_secrets()


def emit_everything(log: logging.Logger) -> None:
    pairs = " ".join(f"{k}={v}" for k, v in PAIRS.items())
    log.info(f"connecting to {DSN} with {pairs}")
    log.info("connecting to %s as %r", DSN, {"password": PAIRS["password"], "user": "apsup"})
    log.warning(
        "extra fields",
        extra={
            "target": DSN,
            "db_password": DB_PASSWORD,
            "nested": {"url": f"https://u:{URL_PASSWORD}@h/", "items": [REGISTERED]},
        },
    )
    log.info("registered secret inline: %s and url-quoted %s", REGISTERED, "S3cr3t-Pw%21x")
    try:
        processor("scope-1")
    except ProcessorError as exc:
        log.exception("invocation failed")
        log_event(
            log,
            "invocation.failed",
            level=logging.ERROR,
            exc=exc,
            binding="b",
            family="fam",
            scope="scope-1",
            trigger="retry",
            request_generation=3,
            worker_id="w-1",
            term=7,
            stage="run",
            error_code=1,
            retry_count=2,
            retry_delay=4.0,
        )
    log.info("stack too", stack_info=True, extra={"note": f"token: {PAIRS['token']}"})


@pytest.mark.parametrize("fmt", ["json", "human"])
def test_no_secret_reaches_the_output(configure, fmt: str) -> None:
    stream = configure(fmt)
    emit_everything(logging.getLogger("apsup.test.redaction"))
    out = stream.getvalue()
    assert "invocation failed" in out and "ProcessorError" in out
    for secret in SECRETS:
        assert secret not in out, f"{secret!r} leaked in {fmt} output"
    assert SOURCE_MARKER not in out  # truncated before the tail of the Source body
    assert "***" in out
    if fmt == "json":
        lines = [orjson.loads(line) for line in out.splitlines()]
        assert {"ts", "level", "logger", "msg"} <= set(lines[0])
        failed = next(rec for rec in lines if rec.get("event") == "invocation.failed")
        assert set(FAILURE_FIELDS) <= set(failed)
        assert failed["exception_type"].endswith("ProcessorError")
        assert len(failed["error"]) <= MAX_EXCEPTION_MESSAGE
        assert "exc" not in failed  # the failure log carries no traceback
        traced = next(rec for rec in lines if rec["msg"] == "invocation failed")
        assert "direct cause" in traced["exc"] and "ConnectionError" in traced["exc"]


def test_auto_format_is_json_for_a_non_tty(configure) -> None:
    stream = configure("auto")
    logging.getLogger("apsup.test").info("hello %s", "world")
    assert orjson.loads(stream.getvalue())["msg"] == "hello world"


def test_reconfiguring_replaces_the_handler(configure) -> None:
    first = configure("json")
    second = configure("json")
    logging.getLogger("apsup.test").info("once")
    assert first.getvalue() == "" and second.getvalue().count("once") == 1


@pytest.mark.parametrize(
    ("text", "leak"),
    [
        ("postgres://bob:pa:ss@host/db", "pa:ss"),
        ("mysql+pymysql://root:p@ss@127.0.0.1:3306/x", "p@ss"),
        ('{"password": "json-pw", "n": 1}', "json-pw"),
        ("PGPASSWORD=env-pw psql", "env-pw"),
        ("client_secret: 'quoted value'", "quoted value"),
        ("api-key=k-123&x=1", "k-123"),
        ("Authorization: Bearer eyJhbGciOi.abc.def", "eyJhbGciOi"),
        ("login failed: password hunter2 rejected", "hunter2"),  # prose, no '=' or ':'
        ("the token is s3cr3t-value", "s3cr3t-value"),
        ("RuntimeError(cannot connect, password=hunter2)", "hunter2"),
    ],
)
def test_redact_rules(text: str, leak: str) -> None:
    assert leak not in redact(text)


def test_redact_keeps_ordinary_text() -> None:
    text = "family=topic-memory scope=s-1 retry_delay=2.5 url=https://example.org/a"
    assert redact(text) == text
    prose = "password authentication failed for user root; token expired"
    assert redact(prose) == prose


def test_safe_url_masks_password_and_drops_query() -> None:
    assert safe_url("mysql+pymysql://root:pw@h:3306/db?ssl_key=/k") == (
        "mysql+pymysql://root:***@h:3306/db"
    )
    assert safe_url("sqlite:////var/lib/apsup.db") == "sqlite:////var/lib/apsup.db"


def test_exception_fields_truncate_after_redacting() -> None:
    clear_secrets()
    secret = "x" * 150 + "-registered-tail"
    register_secret(secret)
    try:
        fields = exception_fields(RuntimeError("a" * 100 + secret))
    finally:
        clear_secrets()
    assert fields["exception_type"] == "RuntimeError"
    assert "x" * 150 not in fields["error"]  # a cut secret would leak its prefix
    assert len(fields["error"]) <= MAX_EXCEPTION_MESSAGE


def test_log_event_never_raises(configure) -> None:
    class Evil:
        def __str__(self) -> str:
            raise RuntimeError("boom")

    stream = configure("json")
    log = logging.getLogger("apsup.test")
    log_event(log, "odd", thing=Evil(), name="reserved-attr-name", process=1)
    record = orjson.loads(stream.getvalue())
    assert record["event"] == "odd" and record["name"] == "reserved-attr-name"
    # bad %-args (pytest's own capture handler would raise on them, so format directly)
    bad = logging.LogRecord("t", logging.INFO, __file__, 1, "bad %s %s", ("only-one",), None)
    assert orjson.loads(JsonFormatter().format(bad))["msg"].startswith("bad %s")
    assert HumanFormatter().format(bad)


def _noop(scope_id: str, ctx: object) -> None:
    pass


def test_startup_record(configure) -> None:
    fam = family("topic-memory", interval=300, registry=Registry())(_noop)
    stream = configure("json")
    log_startup(
        logging.getLogger("apsup.test"),
        mode="global",
        role="all",
        families=[fam],
        terms={"global": 3},
        aliases=["ARTIFACT_PROCESSING_MAX_WORKERS"],
        database_url=DSN,
    )
    rec = orjson.loads(stream.getvalue())
    assert rec["event"] == "startup" and rec["mode"] == "global" and rec["terms"] == {"global": 3}
    assert rec["families"][0] == {
        "family": "topic-memory",
        "binding": "topic-memory",
        "schedule": "interval 300s",
        "max_workers": 4,
        "timeout": 600.0,
    }
    assert DB_PASSWORD not in stream.getvalue() and rec["database"].endswith(
        "@db.internal:3306/apsup"
    )
