"""``apsup``: run | migrate | check-config | status | trigger | scopes | families | demo |
maintenance.

Exit codes: 0 ok, 1 runtime failure, 2 configuration error (the message says what to change),
3 another host already runs on this SQLite database.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from apsup.errors import ApsupError, ConfigError, HostConflictError
from apsup.registry import Registry, default_registry

EXIT_CONFIG = 2
EXIT_HOST_CONFLICT = 3


def _import_apps(modules: Sequence[str]) -> Registry:
    """Import the modules that declare families; they register into the default registry."""
    if not modules:
        raise ConfigError("pass --app MODULE (the module that declares your @family processors)")
    # Like Celery and Dramatiq: the application's own package is importable from where it runs
    # (a console script's sys.path starts with its bin/ folder instead). Worker processes and
    # dedicated children inherit sys.path / the working directory.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    empty_packages = []
    for name in modules:
        before = len(default_registry)
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"--app {name!r} cannot be imported: {exc}") from exc
        if len(default_registry) == before and hasattr(module, "__path__"):
            empty_packages.append((name, module))
    if not len(default_registry):
        for name, module in empty_packages:
            _package_without_families(name, module)
    default_registry.validate()
    return default_registry


def _package_without_families(name: str, package: Any) -> None:
    """A package whose import registers no family (``--app apsup.families``): name the modules
    inside it that do, rather than report an empty registry."""
    import pkgutil

    inner = sorted(
        f"{name}.{m.name}"
        for m in pkgutil.iter_modules(package.__path__)
        if not m.name.startswith("_")
    )
    if not inner:
        return
    raise ConfigError(
        f"--app {name!r} is a package that registers no family itself; name its modules: "
        + " ".join(f"--app {m}" for m in inner)
    )


def _settings(args: argparse.Namespace, registry: Registry) -> Any:
    from apsup.config import Settings

    env = None
    if getattr(args, "db", None):
        env = dict(os.environ)
        env[f"{Settings.default_prefix()}DATABASE_URL"] = args.db
    return Settings.load(registry, env=env)


def _db_url(args: argparse.Namespace) -> str:
    from apsup.config import Settings

    if getattr(args, "db", None):
        return str(args.db)
    return str(Settings.database_url_from_env())


def cmd_demo(args: argparse.Namespace) -> int:
    from apsup.demo import run_demo

    run_demo(args.db_path, args.seconds)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from apsup.store import backend_kind, redact_url
    from apsup.store.revision import migrate

    url = _db_url(args)
    backend_kind(url)  # a bad URL is a one-line configuration error, offline too
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    families = args.with_reference_families
    if args.sql:
        migrate(url, args.revision, reference_families=families, sql=True)
        return 0
    migrate(url, args.revision, reference_families=families)
    what = args.revision or ("head, with the reference families" if families else "head")
    print(f"migrated {redact_url(url)} to {what}")
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    registry = _import_apps(args.app)
    settings = _settings(args, registry)
    if getattr(args, "db", None):  # the database too: schema at this code's revision, tables
        from apsup.store import open_backend
        from apsup.supervisor.startup import check_schema, needs_reference_tables

        backend = open_backend(settings.database_url, control=True)
        try:
            check_schema(backend, reference_families=needs_reference_tables(registry))
        finally:
            backend.dispose()
    report = settings.effective_report()
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for line in _flatten(report):
            print(line)
    return 0


def _flatten(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        out: list[str] = []
        for k, v in value.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        return [f"{prefix} = {', '.join(map(str, value)) or '-'}"]
    return [f"{prefix} = {value}"]


def _scope_argument(raw: str) -> str:
    """The SCOPE argument as a valid Scope id, or a ConfigError saying what is wrong with it
    (argv bytes that are not UTF-8 arrive as lone surrogates and cannot be stored)."""
    from apsup.errors import IntentError
    from apsup.store.intents import check_scope_id

    try:
        return check_scope_id(raw)
    except IntentError as exc:
        raise ConfigError(f"the SCOPE argument is not a valid Scope id: {exc}") from None


def _require_schema(backend: Any) -> None:
    """Refuse a database without the apsup tables before writing anything to it."""
    from sqlalchemy import select
    from sqlalchemy.exc import DBAPIError

    from apsup.store.schema import counters

    try:
        with backend.read() as conn:
            conn.execute(select(counters.c.name).limit(1)).all()
    except DBAPIError as exc:
        text = str(exc.orig).lower()
        if "no such table" in text or "doesn't exist" in text or "does not exist" in text:
            raise ConfigError(
                f"the apsup schema is missing in {backend.describe()}: run `apsup migrate` first"
            ) from None
        raise


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {raw!r}")
    return value


def cmd_trigger(args: argparse.Namespace) -> int:
    from apsup.store import backend_kind, open_backend
    from apsup.supervisor.control import notify

    registry = _import_apps(args.app)
    fam = registry.get(args.family)
    scope = _scope_argument(args.scope)
    url = _db_url(args)
    backend = open_backend(url)
    try:
        _require_schema(backend)
        with backend.transaction() as conn:
            generation = fam.request(conn, scope)
    finally:
        backend.dispose()
    if backend_kind(url) == "sqlite":
        delivered = notify(url, fam.name)
        note = "" if delivered else " (no local host notified; it is recovered when one runs)"
    else:  # the commit nudged the leaders membership names; their poll is the safety net
        note = " (the leader is woken at once, else its poll finds it)"
    print(f"accepted: {fam.name} scope {args.scope!r} requested generation {generation}{note}")
    return 0


def _operator_action(args: argparse.Namespace, action: Any, *, scoped: bool) -> int:
    """One operator action in its own transaction, then a wake-up for a local SQLite host."""
    from apsup.store import open_backend
    from apsup.supervisor.control import notify

    registry = _import_apps(args.app)
    fam = registry.get(args.family)
    url = _db_url(args)
    backend = open_backend(url)
    try:
        _require_schema(backend)
        with backend.transaction() as conn:
            if scoped:
                message = action(conn, fam, _scope_argument(args.scope))
            else:
                message = action(conn, fam)
    finally:
        backend.dispose()
    notify(url, fam.name)
    print(message)
    return 0


def cmd_scopes(args: argparse.Namespace) -> int:
    from apsup import operator

    if args.action != "list":
        action = getattr(operator, args.action)
        return _operator_action(args, action, scoped=True)
    from apsup.store import open_backend

    registry = _import_apps(args.app)
    fam = registry.get(args.family)
    backend = open_backend(_db_url(args))
    try:
        _require_schema(backend)
        with backend.read() as conn:
            rows = operator.scopes(conn, fam, failing=args.failing, limit=args.limit)
            paused = operator.paused(conn, fam)
    finally:
        backend.dispose()
    if args.json:
        doc = {"family": fam.name, "paused": paused, "scopes": [r.as_dict() for r in rows]}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(f"{fam.name}{' (paused)' if paused else ''}: {len(rows)} Scope(s)")
    header = (
        f"{'SCOPE':<28} {'REQ':>5} {'DONE':>5} {'FAILS':>5} {'PARKED':<6} NEXT ATTEMPT / LAST ERROR"
    )
    print(header)
    for r in rows:
        error = f"{r.error_type}: {r.error}" if r.error_type else ""
        print(
            f"{r.scope[:28]:<28} {r.requested_generation:>5} {r.handled_generation:>5} "
            f"{r.consecutive_failures:>5} {'yes' if r.parked else '':<6} "
            f"{r.next_attempt_at or '-'} {error[:120]}"
        )
    return 0


def cmd_families(args: argparse.Namespace) -> int:
    from apsup import operator

    return _operator_action(args, getattr(operator, args.action), scoped=False)


def cmd_run(args: argparse.Namespace) -> int:
    from apsup.supervisor.runtime import Runtime

    registry = _import_apps(args.app)
    settings = _settings(args, registry)
    Runtime(settings, registry).run()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from apsup.observability.status_cli import main as status_main

    return int(status_main(args))


def cmd_switch_mode(args: argparse.Namespace) -> int:
    from apsup.supervisor.maintenance import switch_mode

    registry = _import_apps(args.app)
    settings = _settings(args, registry)
    report = switch_mode(settings, args.to, force=args.force)
    print(report)
    return 0


def _version() -> str:
    from apsup import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apsup",
        description="Artifact Processing Supervisor. Configuration comes from "
        "POWERCONTEXT_SERVER_RUNTIME_* variables (see `apsup check-config`).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"apsup {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_db(p: argparse.ArgumentParser) -> None:
        p.add_argument("--db", help="database URL (default: ..._DATABASE_URL or ./var/apsup.db)")

    def with_app(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--app", action="append", default=[], help="module declaring @family processors"
        )

    p = sub.add_parser("run", help="run the configured role and mode")
    with_app(p)
    with_db(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("migrate", help="create/upgrade apsup's schema (apsup_alembic_version)")
    with_db(p)
    p.add_argument(
        "--revision", default=None, help="one Alembic target (default: newest of each branch)"
    )
    p.add_argument(
        "--with-reference-families",
        action="store_true",
        help="also create the reference families' tables (topic_*, experience_*, ...)",
    )
    p.add_argument(
        "--sql", action="store_true", help="print the DDL for a new database; connect to nothing"
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("check-config", help="print the effective configuration (no secrets)")
    with_app(p)
    with_db(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("status", help="per-family view: capacity, ready, retry-wait, requests")
    with_db(p)
    p.add_argument("--url", help="status endpoint of the running host (http://127.0.0.1:PORT)")
    p.add_argument(
        "--token-file",
        help="file holding the replicas' console token, for --url beyond loopback "
        "(default: CONSOLE_TOKEN_FILE / CONSOLE_TOKEN of the environment)",
    )
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--json", action="store_true", help="print JSON once and exit")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("trigger", help="accept an explicit request for FAMILY SCOPE")
    with_app(p)
    with_db(p)
    p.add_argument("family")
    p.add_argument("scope")
    p.set_defaults(func=cmd_trigger)

    p = sub.add_parser("scopes", help="list a family's Scopes; retry, park, unpark or stop one")
    ssub = p.add_subparsers(dest="action", required=True)
    s = ssub.add_parser("list", help="FAMILY's Scopes with their failure state")
    with_app(s)
    with_db(s)
    s.add_argument("family")
    s.add_argument("--failing", action="store_true", help="only failing or parked Scopes")
    s.add_argument("--json", action="store_true")
    s.add_argument("--limit", type=_positive_int, default=100)
    s.set_defaults(func=cmd_scopes)
    for action, text in (
        ("retry", "attempt a failing Scope now instead of at its backoff time"),
        ("park", "never dispatch this Scope (its requests are kept) until unparked"),
        ("unpark", "dispatch a parked Scope again"),
        ("stop", "stop its running invocation (SIGTERM, then SIGKILL) and park it"),
    ):
        s = ssub.add_parser(action, help=text)
        with_app(s)
        with_db(s)
        s.add_argument("family")
        s.add_argument("scope")
        s.set_defaults(func=cmd_scopes)

    p = sub.add_parser("families", help="pause or resume a family on every replica")
    fsub = p.add_subparsers(dest="action", required=True)
    for action, text in (
        ("pause", "start no new invocation of FAMILY on any replica (running ones finish)"),
        ("resume", "start invocations of a paused FAMILY again"),
    ):
        s = fsub.add_parser(action, help=text)
        with_app(s)
        with_db(s)
        s.add_argument("family")
        s.set_defaults(func=cmd_families)

    p = sub.add_parser("demo", help="run a demo workload on SQLite with a live view")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--db-path", default="var/demo.db")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("maintenance", help="maintenance procedures (run with all hosts stopped)")
    msub = p.add_subparsers(dest="maintenance", required=True)
    m = msub.add_parser("switch-mode", help="invalidate old-mode terms (RFC §9)")
    with_app(m)
    with_db(m)
    m.add_argument("--to", required=True, choices=["global", "dedicated"])
    m.add_argument(
        "--force",
        action="store_true",
        help="MySQL: proceed although a Lease is still live (its holder is known to be dead)",
    )
    m.set_defaults(func=cmd_switch_mode)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
    try:
        return int(args.func(args))
    except HostConflictError as exc:
        print(f"apsup: {exc}", file=sys.stderr)
        return EXIT_HOST_CONFLICT
    except LookupError as exc:  # an unknown Scope (``apsup.operator.UnknownScope``)
        print(f"apsup: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as exc:
        print(f"apsup: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ApsupError as exc:
        print(f"apsup: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the host installed its own handlers
        print("apsup: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        from sqlalchemy.exc import DBAPIError

        if not isinstance(exc, DBAPIError):
            raise
        # One line, not a traceback: the driver's own message (no SQL, no parameters, no DSN).
        lines = str(exc.orig).strip().splitlines()
        reason = lines[0] if lines else ""
        print(f"apsup: database error ({type(exc.orig).__name__}): {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
