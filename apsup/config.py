"""Settings: the runtime configuration, read once at startup from the environment (RFC §10, §11).

Every variable lives under one prefix (``POWERCONTEXT_SERVER_RUNTIME_`` unless overridden); the
fields are the lowercase names. Startup is the only time configuration takes effect, so every
mistake is found here, all at once: ``Settings.load`` collects each problem (one line each,
naming the exact variable and what to change) and raises a single ``InvalidSettings``
(a ``ConfigError``).

Decisions that the RFC leaves open:

- One HTTP listener: ``HTTP_PORT`` (unset or 0 = on, any free port; ``off`` = no listener) and
  ``HTTP_HOST`` (default 127.0.0.1) serve metrics, health, readiness and status together. On by
  default because ``apsup status`` reads the live columns from it; a SQLite host publishes the
  port it got beside the database for ``apsup status`` to find. ``METRICS_*``/``HEALTH_*``
  are rejected with a pointer to ``HTTP_*`` rather than silently ignored.
- Worker settings (``worker_env``) are prefixed variable names with normalised values, so a
  child can re-load them; names that look secret are never included.
- Strict names: a variable under the prefix that apsup does not read fails startup (a typo must
  not silently keep a default). Per-family-shaped names for a prefix that no registered family
  owns are "configuration for a missing capability". Variables that belong to another component
  sharing the prefix (e.g. the APScheduler sidecar of a not-yet-migrated family) are listed in
  ``IGNORE_KEYS``: comma-separated names without the prefix, ``*`` wildcards allowed. It never
  hides a variable apsup reads.
- A registered family's own settings (``P_<NAME>``, e.g. ``TOPIC_MEMORY_WINDOW_SOURCES``) are
  accepted and handed to its Workers (``worker_env``), unless ``<NAME>`` is a near-miss of a
  scheduler key (``P_MAX_WORKER`` fails with "did you mean"). Names ending in a scheduler key
  (``_CRON``, ``_MAX_WORKERS``, ...) are always scheduler config.
- Empty values count as unset (templated compose/k8s files often emit ``NAME=``).
- Enumerations are case-insensitive; numbers are plain decimals, finite.
- ``P_SCHEDULE_SECONDS=0`` disables automatic admission (the legacy meaning); negative fails.
  ``P_SCHEDULE_ENABLED=false`` disables it whatever the policy; ``true`` requires a policy.
  ``P_CRON`` without ``P_TIMEZONE`` keeps the decorator's cron timezone if it declared one,
  otherwise fails. ``P_TIMEZONE`` alone re-zones the decorator's cron.
- SQLite: only role ``all``; a relative path is made absolute (Workers rebuild the engine from
  the URL); an in-memory database is refused (Workers could not see it).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy.engine import make_url

from apsup.errors import ConfigError
from apsup.errors import InvalidSettings as InvalidSettings
from apsup.policy import MAX_INTERVAL_SECONDS, Cron, Disabled, Policy, cron_problem
from apsup.registry import (
    MAX_TIMEOUT_SECONDS,
    MAX_WORKERS_LIMIT,
    Family,
    Registry,
    default_registry,
    make_policy,
)
from apsup.store import backend_kind, redact_url
from apsup.store.limits import CONNECT_TIMEOUT, READ_TIMEOUT, explicit, parse_limits
from apsup.supervisor.lease_keeper import default_renew_deadline

__all__ = [
    "ALIASES",
    "DEFAULT_PREFIX",
    "FAMILY_KEYS",
    "InvalidSettings",
    "Settings",
]

T = TypeVar("T")

DEFAULT_PREFIX = "POWERCONTEXT_SERVER_RUNTIME_"
MODES = ("global", "dedicated")
DEFAULT_LEASE_SECONDS = 15.0
ROLES = ("all", "api", "background")
LOG_FORMATS = ("auto", "json", "human")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

MODE = "ARTIFACT_PROCESSING_SUPERVISOR_MODE"
ROLE = "ARTIFACT_PROCESSING_ROLE"
GLOBAL_KEYS = (
    MODE,
    ROLE,
    "DATABASE_URL",
    "HTTP_HOST",
    "HTTP_PORT",
    "LEASE_SECONDS",
    "RENEW_SECONDS",
    "RENEW_DEADLINE_SECONDS",
    "POLL_SECONDS",
    "SHUTDOWN_GRACE_SECONDS",
    "SHUTDOWN_DRAIN_SECONDS",
    "REPLICA_ID",
    "CONSOLE_TOKEN",
    "CONSOLE_TOKEN_FILE",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "IGNORE_KEYS",
)
#: Names from other designs that would otherwise be silently ignored.
MOVED = {
    "METRICS_PORT": "HTTP_PORT",
    "HEALTH_PORT": "HTTP_PORT",
    "METRICS_HOST": "HTTP_HOST",
    "HEALTH_HOST": "HTTP_HOST",
}

#: Per-family keys, appended to ``Family.prefix`` + ``_``. No key is a suffix of another, so a
#: name parses into (prefix, key) in at most one way.
FAMILY_KEYS = (
    "SCHEDULE_SECONDS",
    "SCHEDULE_ENABLED",
    "CRON",
    "TIMEZONE",
    "MAX_WORKERS",
    "WORKER_TIMEOUT_SECONDS",
)
#: Names shaped like per-family config (MAX_CONCURRENCY is Profile's legacy name).
_FAMILY_SHAPED = (*FAMILY_KEYS, "MAX_CONCURRENCY")
#: Family prefixes that would make a per-family name ambiguous with a global or alias name.
RESERVED_PREFIXES = frozenset({"ARTIFACT_PROCESSING"})


@dataclass(frozen=True)
class Alias:
    """A legacy name that still sets one family's key (RFC §11)."""

    old: str
    prefix: str
    key: str

    @property
    def new(self) -> str:
        return f"{self.prefix}_{self.key}"


ALIASES = (
    Alias("SCHEDULE_SECONDS", "MEMORY", "SCHEDULE_SECONDS"),
    Alias("PROFILE_MAX_CONCURRENCY", "PROFILE", "MAX_WORKERS"),
    # Topic Memory only: never a shared budget, never copied to other families.
    Alias("ARTIFACT_PROCESSING_MAX_WORKERS", "TOPIC_MEMORY", "MAX_WORKERS"),
    Alias("ARTIFACT_PROCESSING_WORKER_TIMEOUT_SECONDS", "TOPIC_MEMORY", "WORKER_TIMEOUT_SECONDS"),
)
_ALIAS_BY_OLD = {a.old: a for a in ALIASES}

#: Worker settings never carry anything whose name suggests a secret (the database URL travels
#: in its own context field).
_SECRET_RE = re.compile(r"PASSW|SECRET|CREDENTIAL|DSN|COOKIE|(^|_)(TOKEN|KEYS?|URL|URI|AUTH)$")
_URL_USERINFO_RE = re.compile(r"(?<=://)[^/@\s]*@")


def _show(value: str) -> str:
    """A value quoted for a message: never a URL's user info, never unbounded."""
    shown = _URL_USERINFO_RE.sub("***@", value.strip())
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return repr(shown)


class _Reader:
    """Typed access to the prefixed variables, collecting one message per problem."""

    def __init__(self, env: Mapping[str, str], prefix: str) -> None:
        self.prefix = prefix
        self.names = sorted(k[len(prefix) :] for k in env if k.startswith(prefix))
        self.values = {
            n: env[prefix + n].strip() for n in self.names if env[prefix + n].strip() != ""
        }
        self.problems: list[str] = []

    def var(self, name: str) -> str:
        return self.prefix + name

    def fail(self, name: str, message: str) -> None:
        self.problems.append(f"{self.var(name)}: {message}")

    def parse(self, name: str, convert: Callable[[str], T], expected: str) -> T | None:
        raw = self.values.get(name)
        if raw is None:
            return None
        try:
            return convert(raw)
        except (ValueError, ConfigError):
            self.fail(name, f"expected {expected}, got {_show(raw)}")
            return None

    def choice(self, name: str, options: tuple[str, ...]) -> str | None:
        def convert(raw: str) -> str:
            value = raw.lower() if options[0].islower() else raw.upper()
            if value not in options:
                raise ValueError(raw)
            return value

        return self.parse(name, convert, "one of " + " | ".join(options))


# ASCII only: Python's int()/float() also accept other scripts' digits (U+FF13), '_' separators,
# 'inf' and 'nan', none of which an operator means in a number of seconds or Workers.
_INTEGER_RE = re.compile(r"[+-]?[0-9]{1,19}")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]{1,19}(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")
#: Upper bound of the runtime-wide durations (lease, renewal, poll, shutdown grace).
HOUR = 3600.0


def _number(low: float, *, inclusive: bool, high: float = math.inf) -> Callable[[str], float]:
    def convert(raw: str) -> float:
        if not _NUMBER_RE.fullmatch(raw):
            raise ValueError(raw)
        value = float(raw)
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise ValueError(raw)
        if value > high:
            raise ValueError(raw)
        return value

    return convert


def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def convert(raw: str) -> int:
        if not _INTEGER_RE.fullmatch(raw):
            raise ValueError(raw)
        value = int(raw, 10)
        if value < low or (high is not None and value > high):
            raise ValueError(raw)
        return value

    return convert


def _http_port(raw: str) -> int:
    """A port (0 = any free one), or -1 for ``off``."""
    return -1 if raw.lower() == "off" else _integer(0, 65535)(raw)


def _boolean(raw: str) -> bool:
    value = raw.lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(raw)


def _schedule_seconds(raw: str) -> float:
    """Interval seconds: 0 (disabled) up to a year; larger values overflow datetime maths."""
    value = _number(0, inclusive=True)(raw)
    if value > MAX_INTERVAL_SECONDS:
        raise ValueError(raw)
    return value


def _valid_timezone(name: str) -> bool:
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return False
    return True


def _host(raw: str) -> str:
    if any(c.isspace() for c in raw) or "/" in raw:
        raise ValueError(raw)
    return raw


_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def _replica_id(raw: str) -> str:
    if not _REPLICA_ID.fullmatch(raw):
        raise ValueError(raw)
    return raw


@dataclass(frozen=True)
class Settings:
    """The effective runtime configuration (read-only; built by ``Settings.load``).

    ``families`` holds the effective Family records (decorator defaults overridden by the
    environment), keyed by canonical name. ``sources`` maps each field (``mode``,
    ``families.<name>.policy``, ...) to the variable(s) it came from, or ``default`` /
    ``decorator``.
    """

    prefix: str
    mode: str
    role: str
    database_url: str = field(repr=False)
    backend: str
    http_host: str
    http_port: int | None
    lease_seconds: float
    renew_seconds: float
    poll_seconds: float
    shutdown_grace_seconds: float
    log_format: str
    log_level: str
    families: dict[str, Family]
    aliases_in_use: list[str]
    sources: dict[str, str]
    family_settings: dict[str, dict[str, str]] = field(default_factory=dict, repr=False)
    ignored: list[str] = field(default_factory=list)
    #: After SIGTERM, running Workers may finish for this long before they are stopped.
    shutdown_drain_seconds: float = 30.0
    #: A leader that has not renewed for this long steps down (< LEASE_SECONDS); 0: the
    #: default, two thirds of the Lease (``apsup.supervisor.lease_keeper``).
    renew_deadline_seconds: float = 0.0
    #: This replica's stable name in membership (dedicated placement keeps each family on
    #: the same replica across restarts when it is stable); None: derived at startup.
    replica_id: str | None = None
    #: The console's credential (``CONSOLE_TOKEN_FILE`` or ``CONSOLE_TOKEN``): None keeps the
    #: console read-only and loopback-only. Never logged, never passed to Workers.
    console_token: str | None = field(default=None, repr=False)
    #: Where it was read from (dedicated children are given the path, not the token).
    console_token_file: str | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        prefix: str = DEFAULT_PREFIX,
        registry: Registry | None = None,
    ) -> Settings:
        """``load`` with the default registry unless one is given."""
        return cls.load(default_registry if registry is None else registry, env, prefix)

    @classmethod
    def load(
        cls, registry: Registry, env: Mapping[str, str] | None = None, prefix: str = DEFAULT_PREFIX
    ) -> Settings:
        """Read ``env`` (default ``os.environ``); raise ``InvalidSettings`` listing every problem.

        Does not import processors: ``Registry.validate()`` is the separate entry-point check.
        """
        if not prefix:
            raise ConfigError("the settings prefix must not be empty")
        r = _Reader(os.environ if env is None else env, prefix)
        sources: dict[str, str] = {}
        by_prefix = registry.by_prefix()

        for fam in registry:
            if fam.prefix in RESERVED_PREFIXES:
                r.problems.append(
                    f"family {fam.name!r}: config prefix {fam.prefix!r} is reserved for "
                    "runtime-wide settings; pass a distinct prefix= to @family"
                )

        ignore = [p.strip() for p in r.values.get("IGNORE_KEYS", "").split(",") if p.strip()]
        names = _classify(r, by_prefix, ignore)

        def src(fieldname: str, name: str) -> None:
            sources[fieldname] = r.var(name) if name in r.values else "default"

        mode = r.choice(MODE, MODES) or "global"
        src("mode", MODE)
        role = r.choice(ROLE, ROLES) or "all"
        src("role", ROLE)
        database_url, backend = _database(r, role)
        src("database_url", "DATABASE_URL")
        http_host = r.parse("HTTP_HOST", _host, "a host name or IP address") or "127.0.0.1"
        src("http_host", "HTTP_HOST")
        port = r.parse("HTTP_PORT", _http_port, "an integer port 0-65535, or off")
        http_port = 0 if port is None else (None if port < 0 else port)
        src("http_port", "HTTP_PORT")
        positive = _number(0, inclusive=False, high=HOUR)
        lease = (
            r.parse("LEASE_SECONDS", positive, "a number of seconds > 0 and <= 3600")
            or DEFAULT_LEASE_SECONDS
        )
        src("lease_seconds", "LEASE_SECONDS")
        renew = r.parse("RENEW_SECONDS", positive, "a number of seconds > 0 and <= 3600")
        # The host gives a term up at its renew deadline (default two thirds of the lease); a
        # renewal that fails once must leave room for the next one before that: at most a third.
        if renew is not None and renew > lease / 3 * (1 + 1e-9):
            r.fail(
                "RENEW_SECONDS",
                f"must be shorter than LEASE_SECONDS: at most a third of it ({lease / 3:g}s), "
                f"got {renew:g}s; lower RENEW_SECONDS or raise LEASE_SECONDS to "
                f"{renew * 3:g}s or more",
            )
        renew = lease / 3 if renew is None else renew
        src("renew_seconds", "RENEW_SECONDS")
        deadline = r.parse(
            "RENEW_DEADLINE_SECONDS", positive, "a number of seconds > 0 and <= 3600"
        )
        if deadline is not None and not renew < deadline < lease:
            r.fail(
                "RENEW_DEADLINE_SECONDS",
                f"must lie strictly between RENEW_SECONDS ({renew:g}s) and LEASE_SECONDS "
                f"({lease:g}s), got {deadline:g}s: a leader must give up before its Lease runs "
                "out, and get a renewal attempt in before that",
            )
            deadline = None
        deadline = default_renew_deadline(lease) if deadline is None else deadline
        src("renew_deadline_seconds", "RENEW_DEADLINE_SECONDS")
        _check_limits_against_lease(r, database_url, backend, lease)
        poll = r.parse("POLL_SECONDS", positive, "a number of seconds > 0 and <= 3600") or 2.0
        src("poll_seconds", "POLL_SECONDS")
        grace = r.parse(
            "SHUTDOWN_GRACE_SECONDS",
            _number(0, inclusive=True, high=HOUR),
            "a number of seconds >= 0 and <= 3600",
        )
        src("shutdown_grace_seconds", "SHUTDOWN_GRACE_SECONDS")
        drain = r.parse(
            "SHUTDOWN_DRAIN_SECONDS", _number(0, inclusive=True), "a number of seconds >= 0"
        )
        src("shutdown_drain_seconds", "SHUTDOWN_DRAIN_SECONDS")
        replica_id = r.parse(
            "REPLICA_ID",
            _replica_id,
            "1-64 characters of letters, digits and . _ : - (starting with a letter or digit)",
        )
        src("replica_id", "REPLICA_ID")
        console_token = _console_token(r)
        src(
            "console_token",
            "CONSOLE_TOKEN_FILE" if "CONSOLE_TOKEN_FILE" in r.values else "CONSOLE_TOKEN",
        )
        log_format = r.choice("LOG_FORMAT", LOG_FORMATS) or "auto"
        src("log_format", "LOG_FORMAT")
        log_level = r.choice("LOG_LEVEL", LOG_LEVELS) or "INFO"
        src("log_level", "LOG_LEVEL")

        families: dict[str, Family] = {}
        for fam in registry:
            keys = _resolve_aliases(r, fam, names.family_keys.get(fam.prefix, {}), names.aliases)
            eff = _effective_family(r, fam, keys, sources)
            if eff is not None:
                families[fam.name] = eff

        if r.problems:
            raise InvalidSettings(r.problems)
        return cls(
            prefix=prefix,
            mode=mode,
            role=role,
            database_url=database_url,
            backend=backend,
            http_host=http_host,
            http_port=http_port,
            lease_seconds=lease,
            renew_seconds=renew,
            renew_deadline_seconds=deadline,
            poll_seconds=poll,
            shutdown_grace_seconds=10.0 if grace is None else grace,
            shutdown_drain_seconds=30.0 if drain is None else drain,
            replica_id=replica_id,
            console_token=console_token,
            console_token_file=r.values.get("CONSOLE_TOKEN_FILE") if console_token else None,
            log_format=log_format,
            log_level=log_level,
            families=families,
            aliases_in_use=[f"{r.var(a.old)} -> {r.var(a.new)}" for a in names.aliases],
            sources=sources,
            family_settings={
                f.name: dict(sorted(names.domain.get(f.prefix, {}).items())) for f in registry
            },
            ignored=[r.var(n) for n in names.ignored],
        )

    @staticmethod
    def default_prefix() -> str:
        return DEFAULT_PREFIX

    @staticmethod
    def database_url_from_env(
        env: Mapping[str, str] | None = None, prefix: str = DEFAULT_PREFIX
    ) -> str:
        """Only ``DATABASE_URL`` (default and checks as in ``load``), for ``apsup migrate``."""
        r = _Reader(os.environ if env is None else env, prefix)
        url, _ = _database(r, None)
        if r.problems:
            raise InvalidSettings(r.problems)
        return url

    @staticmethod
    def lease_seconds_from_env(
        env: Mapping[str, str] | None = None, prefix: str = DEFAULT_PREFIX
    ) -> float:
        """Only ``LEASE_SECONDS`` (default and checks as in ``load``), for tools that judge
        membership rows by the replicas' Lease."""
        r = _Reader(os.environ if env is None else env, prefix)
        positive = _number(0, inclusive=False, high=HOUR)
        lease = r.parse("LEASE_SECONDS", positive, "a number of seconds > 0 and <= 3600")
        if r.problems:
            raise InvalidSettings(r.problems)
        return lease or DEFAULT_LEASE_SECONDS

    @staticmethod
    def console_token_from_env(
        env: Mapping[str, str] | None = None, prefix: str = DEFAULT_PREFIX
    ) -> str | None:
        """Only the console credential (``CONSOLE_TOKEN_FILE`` / ``CONSOLE_TOKEN``, checked as
        in ``load``), for ``apsup status --url`` against a replica that asks for one."""
        r = _Reader(os.environ if env is None else env, prefix)
        token = _console_token(r)
        if r.problems:
            raise InvalidSettings(r.problems)
        return token

    # -- views ------------------------------------------------------------------------------------
    def supervisor_keys(self) -> list[str]:
        """The Lease keys this mode organises: one ``global``, or one per family (RFC §8)."""
        if self.mode == "global":
            return ["global"]
        return [fam.supervisor_key for fam in self.families.values()]

    def effective_report(self) -> dict[str, Any]:
        """The startup log record (RFC §12): JSON-able, the database URL redacted."""
        return {
            "prefix": self.prefix,
            "mode": self.mode,
            "role": self.role,
            "database": redact_url(self.database_url),
            "backend": self.backend,
            "supervisor_keys": self.supervisor_keys(),
            "http": {"host": self.http_host, "port": self.http_port},
            "lease_seconds": self.lease_seconds,
            "renew_seconds": self.renew_seconds,
            "renew_deadline_seconds": self.renew_deadline_seconds,
            "poll_seconds": self.poll_seconds,
            "shutdown_grace_seconds": self.shutdown_grace_seconds,
            "shutdown_drain_seconds": self.shutdown_drain_seconds,
            "replica_id": self.replica_id,
            "console_actions": "on" if self.console_token else "off",
            "log_format": self.log_format,
            "log_level": self.log_level,
            "families": {
                name: {
                    "binding": fam.binding_name,
                    "prefix": fam.prefix,
                    "policy": fam.policy.describe(),
                    "max_workers": fam.max_workers,
                    "timeout": fam.timeout,
                    "entry_point": fam.entry_point,
                    "settings": {
                        k: "<redacted>" if _looks_secret(k) else _URL_USERINFO_RE.sub("***@", v)
                        for k, v in self.family_settings.get(name, {}).items()
                    },
                    "sources": {
                        k: self.sources[f"families.{name}.{k}"]
                        for k in ("policy", "max_workers", "timeout")
                    },
                }
                for name, fam in self.families.items()
            },
            "aliases_in_use": list(self.aliases_in_use),
            "ignored_variables": list(self.ignored),
            "sources": {k: v for k, v in self.sources.items() if not k.startswith("families.")},
        }

    def worker_env(self, family: str | None = None) -> dict[str, str]:
        """Prefixed variables a Worker needs (for ``ExecutionContext.settings``).

        Normalised runtime values plus ``family``'s budget and its own settings (every family's
        when None), so ``Settings.load(registry, env=settings.worker_env())`` reproduces them.
        Nothing whose name suggests a secret: the database URL travels in its own context
        field, and a processor's credentials stay in the environment it inherits.
        """
        out = {MODE: self.mode, "LOG_FORMAT": self.log_format, "LOG_LEVEL": self.log_level}
        chosen = self.families.values() if family is None else [self.families[family]]
        for fam in chosen:
            out[f"{fam.prefix}_MAX_WORKERS"] = str(fam.max_workers)
            out[f"{fam.prefix}_WORKER_TIMEOUT_SECONDS"] = repr(float(fam.timeout))
            out.update(self.family_settings.get(fam.name, {}))
        return {self.prefix + k: v for k, v in out.items() if not _looks_secret(k)}


#: The shortest console credential accepted (a guessable token would open every action).
CONSOLE_TOKEN_MIN = 16


def _console_token(r: _Reader) -> str | None:
    """The console credential from ``CONSOLE_TOKEN_FILE`` (a file holding it) or
    ``CONSOLE_TOKEN``; messages never quote the value."""
    path, inline = r.values.get("CONSOLE_TOKEN_FILE"), r.values.get("CONSOLE_TOKEN")
    if path is not None and inline is not None:
        r.fail("CONSOLE_TOKEN", "set CONSOLE_TOKEN_FILE or CONSOLE_TOKEN, not both")
        return None
    name, token = "CONSOLE_TOKEN", inline
    if path is not None:
        name = "CONSOLE_TOKEN_FILE"
        try:
            token = open(path, encoding="utf-8").read().strip()  # noqa: SIM115
        except (OSError, UnicodeDecodeError) as exc:
            r.fail(name, f"cannot read {path!r} ({type(exc).__name__}); name a readable file")
            return None
    if token is None:
        return None
    token = token.strip()
    if len(token) < CONSOLE_TOKEN_MIN or any(c.isspace() for c in token):
        r.fail(
            name,
            f"the console token must be at least {CONSOLE_TOKEN_MIN} characters without "
            "spaces (for example the output of `openssl rand -hex 24`)",
        )
        return None
    return token


def _looks_secret(name: str) -> bool:
    return _SECRET_RE.search(name) is not None


# -- helpers for load ---------------------------------------------------------------------------


def _split_family_name(name: str) -> tuple[str, str] | None:
    for key in _FAMILY_SHAPED:
        if name.endswith("_" + key) and len(name) > len(key) + 1:
            return name[: -len(key) - 1], key
    return None


@dataclass
class _Names:
    """Every prefixed name, sorted by what it configures."""

    family_keys: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix: {key: name}
    domain: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix: {name: value}
    aliases: list[Alias] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _owner(name: str, prefixes: Iterable[str]) -> str | None:
    """The longest registered prefix ``name`` starts with (``P_...``), if any."""
    owners = [p for p in prefixes if name.startswith(p + "_") and len(name) > len(p) + 1]
    return max(owners, key=len) if owners else None


def _classify(r: _Reader, by_prefix: Mapping[str, Family], ignore: list[str]) -> _Names:
    """Sort every prefixed name: global, alias, family key, family's own setting, ignored, or a
    problem (recorded on ``r``)."""
    out = _Names()
    known = [*GLOBAL_KEYS, *_ALIAS_BY_OLD]
    known += [f"{p}_{k}" for p in by_prefix for k in FAMILY_KEYS]

    def ignorable(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in ignore)

    for name in r.names:
        if name in GLOBAL_KEYS:
            continue
        alias = _ALIAS_BY_OLD.get(name)
        if alias is not None and alias.prefix in by_prefix:
            if name in r.values:
                out.aliases.append(alias)
            continue
        split = _split_family_name(name)
        if split and split[0] in by_prefix and split[1] in FAMILY_KEYS:
            out.family_keys.setdefault(split[0], {})[split[1]] = name
            continue
        owner = None if split else _owner(name, by_prefix)
        if owner is not None:
            rest = name[len(owner) + 1 :]
            close = difflib.get_close_matches(rest, FAMILY_KEYS, n=1, cutoff=0.8)
            if close:
                r.fail(name, f"not a setting; did you mean {r.var(f'{owner}_{close[0]}')}?")
            elif name in r.values:
                out.domain.setdefault(owner, {})[name] = r.values[name]
            continue
        if ignorable(name):
            out.ignored.append(name)
            continue
        if alias is not None:
            r.fail(
                name,
                f"compatibility alias of {r.var(alias.new)}, but no registered family has "
                f"prefix {alias.prefix!r} (configuration for a missing capability); "
                f"{_registered(by_prefix)}",
            )
        elif name in MOVED:
            r.fail(
                name,
                f"not a setting; one listener serves metrics, health and status: "
                f"set {r.var(MOVED[name])} instead",
            )
        elif split and split[0] in by_prefix:
            better = "MAX_WORKERS" if split[1] == "MAX_CONCURRENCY" else None
            hint = f"; did you mean {r.var(f'{split[0]}_{better}')}?" if better else ""
            r.fail(name, f"not a setting of family {by_prefix[split[0]].name!r}{hint}")
        elif split:
            r.fail(
                name,
                f"configuration for a missing capability: no registered family has prefix "
                f"{split[0]!r} ({_registered(by_prefix)}){_did_you_mean(r, name, known)}",
            )
        else:
            r.fail(
                name,
                f"unknown setting{_did_you_mean(r, name, known)}; if it belongs to another "
                f"component, list it in {r.var('IGNORE_KEYS')}",
            )
    return out


def _registered(by_prefix: Mapping[str, Family]) -> str:
    return "registered prefixes: " + (", ".join(sorted(by_prefix)) or "none")


def _did_you_mean(r: _Reader, name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f"; did you mean {r.var(close[0])}?" if close else ""


def _check_limits_against_lease(r: _Reader, url: str, backend: str, lease: float) -> None:
    """Explicit MySQL time limits must let a cut-off host notice before its Lease runs out."""
    if backend != "mysql" or not explicit(url) & {CONNECT_TIMEOUT, READ_TIMEOUT}:
        return
    try:
        limits = parse_limits(url)
    except ConfigError:
        return  # already reported
    worst = limits.read_timeout + limits.connect_timeout
    if worst >= lease:
        r.fail(
            "DATABASE_URL",
            f"{READ_TIMEOUT} + {CONNECT_TIMEOUT} ({worst:g}s) must be shorter than "
            f"{r.var('LEASE_SECONDS')} ({lease:g}s): lower them or lengthen the lease",
        )


def _database(r: _Reader, role: str | None) -> tuple[str, str]:
    url = r.values.get("DATABASE_URL") or f"sqlite:///{(Path.cwd() / 'var' / 'apsup.db')}"
    try:
        kind = backend_kind(url)
    except ConfigError as exc:
        r.fail("DATABASE_URL", str(exc))
        return url, "invalid"
    try:
        parse_limits(url)  # the host's time limits on database calls
    except ConfigError as exc:
        r.fail("DATABASE_URL", str(exc))
    if kind != "sqlite":
        return url, kind
    parsed = make_url(url)
    database = parsed.database or ""
    if database in {"", ":memory:"} or parsed.query.get("mode") == "memory":
        r.fail(
            "DATABASE_URL",
            f"{redact_url(url)!r} is an in-memory SQLite database, invisible to Worker "
            "processes; use a file, e.g. sqlite:////var/lib/apsup/apsup.db",
        )
    elif not database.startswith("file:") and not Path(database).is_absolute():
        url = parsed.set(database=str(Path(database).resolve())).render_as_string(
            hide_password=False
        )
    if role not in (None, "all"):
        r.fail(
            ROLE,
            f"role {role!r} needs a shared database; SQLite ({redact_url(url)!r}) runs one "
            f"host with role 'all': set {r.var(ROLE)}=all or {r.var('DATABASE_URL')} to a "
            "MySQL/OceanBase URL",
        )
    return url, kind


def _resolve_aliases(
    r: _Reader, fam: Family, names: Mapping[str, str], aliases: list[Alias]
) -> dict[str, str]:
    """The family's {key: variable name} with legacy aliases folded in (RFC §11)."""
    keys = dict(names)
    for alias in aliases:
        if alias.prefix != fam.prefix:
            continue
        new = keys.get(alias.key)
        if new is None or new not in r.values:
            keys[alias.key] = alias.old
            continue
        convert: Callable[[str], Any] = (
            _integer(-(2**63)) if alias.key == "MAX_WORKERS" else _number(-math.inf, inclusive=True)
        )
        try:
            same = convert(r.values[alias.old]) == convert(r.values[new])
        except ValueError:
            same = r.values[alias.old] == r.values[new]
        if not same:
            r.fail(
                alias.old,
                f"compatibility alias of {r.var(new)} but the two disagree "
                f"({_show(r.values[alias.old])} vs {_show(r.values[new])}); set only "
                f"{r.var(new)}",
            )
    return keys


def _effective_family(
    r: _Reader, fam: Family, keys: Mapping[str, str], sources: dict[str, str]
) -> Family | None:
    """Decorator defaults overridden by the family's variables; None if any was invalid."""
    before = len(r.problems)
    present = {k: n for k, n in keys.items() if n in r.values}
    p = fam.prefix

    def name(key: str) -> str:
        return present.get(key, f"{p}_{key}")

    interval = r.parse(
        name("SCHEDULE_SECONDS"),
        _schedule_seconds,
        f"a number of seconds >= 0 (0 disables automatic admission) and <= "
        f"{MAX_INTERVAL_SECONDS:.0f} (a year)",
    )
    enabled = r.parse(name("SCHEDULE_ENABLED"), _boolean, "true or false")
    workers = r.parse(
        name("MAX_WORKERS"),
        _integer(1, MAX_WORKERS_LIMIT),
        f"an integer >= 1 and <= {MAX_WORKERS_LIMIT}",
    )
    timeout = r.parse(
        name("WORKER_TIMEOUT_SECONDS"),
        _number(0, inclusive=False, high=MAX_TIMEOUT_SECONDS),
        f"a number of seconds > 0 and <= {MAX_TIMEOUT_SECONDS:g} (7 days)",
    )
    cron = r.values[present["CRON"]] if "CRON" in present else None
    tz = r.values[present["TIMEZONE"]] if "TIMEZONE" in present else None
    if tz is not None and not _valid_timezone(tz):
        r.fail(name("TIMEZONE"), f"unknown IANA timezone {_show(tz)}; use e.g. 'Asia/Shanghai'")
    if cron is not None and (problem := cron_problem(cron)) is not None:
        r.fail(name("CRON"), problem)

    policy: Policy = fam.policy
    policy_src = ["decorator"]
    decorator_cron = fam.policy if isinstance(fam.policy, Cron) else None
    if "SCHEDULE_SECONDS" in present and cron is not None:
        r.fail(
            name("SCHEDULE_SECONDS"),
            f"and {r.var(name('CRON'))} are both set; family {fam.name!r} has one policy, "
            "an interval or a cron: unset one",
        )
    elif tz is not None and cron is None and (not decorator_cron or "SCHEDULE_SECONDS" in present):
        r.fail(
            name("TIMEZONE"),
            f"only applies to a cron policy; set {r.var(name('CRON'))} or unset it",
        )
    elif "SCHEDULE_SECONDS" in present:
        if interval is not None:
            policy = make_policy(fam.name, interval or None, None, None)
            policy_src = [r.var(name("SCHEDULE_SECONDS"))]
    elif cron is not None or tz is not None:
        expr = cron if cron is not None else decorator_cron.expr if decorator_cron else None
        zone = tz if tz is not None else decorator_cron.timezone if decorator_cron else None
        if zone is None:
            r.fail(
                name("CRON"),
                f"needs an IANA timezone: set {r.var(name('TIMEZONE'))} (e.g. 'Asia/Shanghai')",
            )
        elif len(r.problems) == before and expr is not None:
            policy = make_policy(fam.name, None, expr, zone)
            policy_src = [r.var(present[k]) for k in ("CRON", "TIMEZONE") if k in present]
    if enabled is False:
        policy, policy_src = Disabled(), [r.var(name("SCHEDULE_ENABLED"))]
    elif enabled is True and isinstance(policy, Disabled) and len(r.problems) == before:
        r.fail(
            name("SCHEDULE_ENABLED"),
            f"is true but family {fam.name!r} has no interval or cron: set "
            f"{r.var(name('SCHEDULE_SECONDS'))} > 0 or {r.var(name('CRON'))}",
        )

    sources[f"families.{fam.name}.policy"] = ", ".join(policy_src)
    sources[f"families.{fam.name}.max_workers"] = (
        r.var(name("MAX_WORKERS")) if workers is not None else "decorator"
    )
    sources[f"families.{fam.name}.timeout"] = (
        r.var(name("WORKER_TIMEOUT_SECONDS")) if timeout is not None else "decorator"
    )
    if len(r.problems) != before:
        return None
    try:
        return fam.with_overrides(
            policy=policy,
            max_workers=fam.max_workers if workers is None else workers,
            timeout=fam.timeout if timeout is None else timeout,
        )
    except ConfigError as exc:  # pragma: no cover - values were validated above
        r.problems.append(str(exc))
        return None
