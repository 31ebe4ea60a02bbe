"""Family registration: the ``@family`` decorator, the frozen ``Family`` record and ``Registry``.

The decorator is passive: it builds a record and adds it to a registry, checking only what can be
checked locally (names, policy). ``Registry.validate()`` runs the cross-family checks at startup
(collisions, importable entry points) so that every mistake fails before anything is scheduled.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apsup.errors import ConfigError
from apsup.policy import Cron, Disabled, Interval, Policy

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection

    from apsup.context import ExecutionContext

Processor = Callable[[str, "ExecutionContext"], Any]  # None, or a coroutine for async def
#: A reconciler rebuilds dirty state from bounded domain facts: called repeatedly with the
#: connection, the family and the previous page token (None first); returns the next token or
#: None when done. It may call ``family.mark_dirty`` but never ``request`` (RFC §11).
Reconciler = Callable[["Connection", "Family", Any], Any]

_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
_PREFIX_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
MAX_NAME_LENGTH = 64
MAX_BINDING_LENGTH = 128
#: Upper bounds that keep every number meaningful (and printable) rather than merely parseable.
MAX_WORKERS_LIMIT = 1024
MAX_TIMEOUT_SECONDS = 7 * 86400.0


def default_prefix(name: str) -> str:
    return name.upper().replace("-", "_")


@dataclass(frozen=True, eq=False)
class Family:
    """One artifact family's registration: its binding, config prefix, policy, budget, processor.

    ``binding_name`` and ``name`` (the artifact family) are one-to-one in this version (RFC §1).
    The record is immutable; settings produce an effective copy with ``with_overrides``.
    """

    name: str
    binding_name: str
    prefix: str
    policy: Policy
    max_workers: int
    timeout: float
    entry_point: str
    processor: Processor = field(repr=False)
    _hooks: dict[str, Any] = field(default_factory=dict, repr=False)
    #: Failure records (logs, ``/status``, the Scope's failure state) carry the redacted,
    #: length-capped exception message. Turn it off for a family whose exception messages may
    #: quote Source text or prompts: only the exception type is kept then.
    log_exception_messages: bool = True

    # -- worker-facing ---------------------------------------------------------------------
    def __call__(self, scope_id: str, ctx: ExecutionContext) -> Any:
        """Call the processor; for an ``async def`` one this returns the coroutine to await."""
        return self.processor(scope_id, ctx)

    @property
    def artifact_family(self) -> str:
        return self.name

    @property
    def supervisor_key(self) -> str:
        """The Lease key of this family's Supervisor in dedicated mode."""
        return f"artifact:{self.name}"

    # -- domain-facing (inside the caller's own transaction) ---------------------------------
    # ``conn`` is any SQLAlchemy Connection of the database apsup runs on, inside the caller's
    # transaction. On SQLite, a running host on this machine is woken when it commits.
    def mark_dirty(self, conn: Connection, scope_id: str) -> int:
        """Advance dirty_generation in the caller's transaction; returns the new generation."""
        from apsup.store import intents
        from apsup.supervisor import control

        control.check_publisher(conn)
        generation = intents.mark_dirty(conn, self.binding_name, scope_id)
        control.wake_on_commit(conn, self.name, scope_id)
        return generation

    def request(self, conn: Connection, scope_id: str) -> int:
        """Accept an explicit invocation request in the caller's transaction; returns G."""
        from apsup.store import intents
        from apsup.supervisor import control

        control.check_publisher(conn)
        generation = intents.request(conn, self.binding_name, scope_id)
        control.wake_on_commit(conn, self.name, scope_id)
        return generation

    async def mark_dirty_async(self, conn: AsyncConnection, scope_id: str) -> int:
        """``mark_dirty`` in the caller's own async transaction (the same sync code, run on it)."""
        return int(await conn.run_sync(self.mark_dirty, scope_id))

    async def request_async(self, conn: AsyncConnection, scope_id: str) -> int:
        """``request`` in the caller's own async transaction (the same sync code, run on it)."""
        return int(await conn.run_sync(self.request, scope_id))

    # Bulk intake: the same as calling ``mark_dirty``/``request`` once per distinct Scope (first
    # appearance order; a Scope listed twice advances once), in a few statements per 500 Scopes.
    def mark_dirty_many(self, conn: Connection, scope_ids: Iterable[str]) -> dict[str, int]:
        """``mark_dirty`` for many Scopes in the caller's transaction; Scope -> new generation."""
        from apsup.store import intents
        from apsup.supervisor import control

        control.check_publisher(conn)
        generations = intents.mark_dirty_many(conn, self.binding_name, scope_ids)
        if generations:
            control.wake_on_commit(conn, self.name, next(iter(generations)))
        return generations

    def request_many(self, conn: Connection, scope_ids: Iterable[str]) -> dict[str, int]:
        """``request`` for many Scopes in the caller's transaction; Scope -> G."""
        from apsup.store import intents
        from apsup.supervisor import control

        control.check_publisher(conn)
        generations = intents.request_many(conn, self.binding_name, scope_ids)
        if generations:
            control.wake_on_commit(conn, self.name, next(iter(generations)))
        return generations

    async def mark_dirty_many_async(
        self, conn: AsyncConnection, scope_ids: Iterable[str]
    ) -> dict[str, int]:
        """``mark_dirty_many`` in the caller's own async transaction."""
        return dict(await conn.run_sync(self.mark_dirty_many, scope_ids))

    async def request_many_async(
        self, conn: AsyncConnection, scope_ids: Iterable[str]
    ) -> dict[str, int]:
        """``request_many`` in the caller's own async transaction."""
        return dict(await conn.run_sync(self.request_many, scope_ids))

    # -- reconciliation ------------------------------------------------------------------------
    def reconciler(self, fn: Reconciler) -> Reconciler:
        """Decorator: register the bounded dirty-state reconstruction for this family."""
        if "reconciler" in self._hooks:
            raise ConfigError(f"family {self.name!r}: reconciler registered twice")
        self._hooks["reconciler"] = fn
        return fn

    @property
    def reconcile(self) -> Reconciler | None:
        return self._hooks.get("reconciler")

    def with_overrides(self, **changes: Any) -> Family:
        """An effective copy (policy/max_workers/timeout from settings); shares hooks."""
        allowed = {"policy", "max_workers", "timeout"}
        unknown = set(changes) - allowed
        if unknown:
            raise ConfigError(f"family {self.name!r}: cannot override {sorted(unknown)}")
        fam = dataclasses.replace(self, **changes)
        _check_budget(fam.name, fam.max_workers, fam.timeout)
        return fam


def _check_budget(name: str, max_workers: Any, timeout: Any) -> None:
    if (
        not isinstance(max_workers, int)
        or isinstance(max_workers, bool)
        or not 1 <= max_workers <= MAX_WORKERS_LIMIT
    ):
        raise ConfigError(
            f"family {name!r}: max_workers must be an integer >= 1 and <= {MAX_WORKERS_LIMIT}, "
            f"got {max_workers!r:.40}"
        )
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not 0 < timeout <= MAX_TIMEOUT_SECONDS
    ):
        raise ConfigError(
            f"family {name!r}: timeout must be > 0 seconds and <= {MAX_TIMEOUT_SECONDS:g} "
            f"(7 days), got {timeout!r:.40}"
        )


def make_policy(
    name: str, interval: float | None, cron: str | None, timezone: str | None
) -> Policy:
    """Exactly one policy: interval, cron+timezone, or neither (automatic admission disabled)."""
    if interval is not None and cron is not None:
        raise ConfigError(
            f"family {name!r}: interval and cron are both set; choose one policy (RFC §1)"
        )
    if cron is not None:
        if not timezone:
            raise ConfigError(f"family {name!r}: cron needs an IANA timezone (field 'timezone')")
        try:
            return Cron(cron, timezone)
        except ConfigError as exc:
            raise ConfigError(f"family {name!r}: {exc}") from exc
    if timezone is not None:
        raise ConfigError(f"family {name!r}: timezone is only meaningful with cron")
    if interval is not None:
        if isinstance(interval, bool) or not isinstance(interval, int | float):
            raise ConfigError(f"family {name!r}: interval must be a number of seconds")
        try:
            return Interval(float(interval))
        except ConfigError as exc:
            raise ConfigError(f"family {name!r}: field 'interval': {exc}") from exc
    return Disabled()


class Registry:
    """The set of registered families, validated as a whole at startup."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def add(self, fam: Family) -> Family:
        for other in self._families.values():
            if other.name == fam.name:
                raise ConfigError(f"family {fam.name!r} is registered twice")
            if other.binding_name == fam.binding_name:
                raise ConfigError(
                    f"family {fam.name!r}: binding {fam.binding_name!r} already belongs to "
                    f"family {other.name!r}; binding names are globally unique"
                )
            if other.prefix == fam.prefix:
                raise ConfigError(
                    f"family {fam.name!r}: config prefix {fam.prefix!r} collides with family "
                    f"{other.name!r}; pass a distinct prefix="
                )
        self._families[fam.name] = fam
        return fam

    def __iter__(self) -> Iterator[Family]:
        return iter(sorted(self._families.values(), key=lambda f: f.name))

    def __len__(self) -> int:
        return len(self._families)

    def __contains__(self, name: object) -> bool:
        return name in self._families

    def get(self, name: str) -> Family:
        try:
            return self._families[name]
        except KeyError:
            known = ", ".join(sorted(self._families)) or "none"
            raise ConfigError(f"unknown family {name!r} (registered: {known})") from None

    def by_binding(self, binding_name: str) -> Family:
        for fam in self._families.values():
            if fam.binding_name == binding_name:
                return fam
        raise ConfigError(f"no family registered for binding {binding_name!r}")

    def by_prefix(self) -> dict[str, Family]:
        return {f.prefix: f for f in self._families.values()}

    def modules(self) -> list[str]:
        """Modules that define the processors; preloaded into the Worker forkserver."""
        return sorted({f.entry_point.split(":", 1)[0] for f in self._families.values()})

    def validate(self) -> None:
        """Startup checks that need the whole registry or imports."""
        if not self._families:
            raise ConfigError(
                "no family is registered; pass --app with the module that defines them"
            )
        for fam in self._families.values():
            resolve_entry_point(fam.entry_point, expect=fam)


def resolve_entry_point(entry_point: str, expect: Family | None = None) -> Family:
    """Import ``module:qualname`` and return the Family it names (used by Workers too)."""
    module_name, _, qualname = entry_point.partition(":")
    where = (
        f"family {expect.name!r}: processor entry point {entry_point!r}"
        if expect
        else (f"processor entry point {entry_point!r}")
    )
    if not module_name or not qualname or "<locals>" in qualname or module_name == "__main__":
        raise ConfigError(
            f"{where} is not importable by name; define the processor at module level in an "
            "importable module (not __main__ or inside a function)"
        )
    try:
        obj: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where} cannot be imported: {exc}") from exc
    if not isinstance(obj, Family):
        raise ConfigError(f"{where} does not name a @family-decorated processor")
    if expect is not None and obj.name != expect.name:
        raise ConfigError(f"{where} resolves to family {obj.name!r}")
    return obj


default_registry = Registry()


def _check_processor(name: str, fn: Any) -> None:
    """Only a plain function or an ``async def`` function: a Worker imports it by name and runs
    it to completion; anything else would be dropped unrun, run as something else, or rebuilt
    from import-time state in every Worker."""
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
        change = "return instead of yield (a Worker would never iterate it)"
    elif inspect.isclass(fn):
        kind, change = "a class", "decorate a module-level function that uses the class"
    elif inspect.ismethod(fn):
        kind = "a bound method"
        change = (
            "decorate a module-level function; build the object it needs inside the "
            "processor (an instance built at import time is the forkserver's copy)"
        )
    elif inspect.isfunction(fn):
        return
    elif callable(fn):
        kind, change = f"a callable {type(fn).__name__} object", "decorate a def or async def"
    else:
        kind, change = f"a {type(fn).__name__}", "decorate a def or async def"
    raise ConfigError(
        f"family {name!r}: the processor is {kind}, not a plain function or async def "
        f"function; {change}"
    )


def family(
    name: str,
    *,
    binding: str | None = None,
    prefix: str | None = None,
    interval: float | None = None,
    cron: str | None = None,
    timezone: str | None = None,
    max_workers: int = 4,
    timeout: float = 600,
    registry: Registry | None = None,
    log_exception_messages: bool = True,
) -> Callable[[Processor], Family]:
    """Register a Scope processor ``fn(scope_id, ctx)`` as an artifact family.

    Returns the ``Family`` record in place of the function, so the module attribute stays the
    importable entry point that Workers resolve.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"family name {name!r} must be lowercase words joined by '-' or '_' "
            f"(e.g. 'topic-memory'), at most {MAX_NAME_LENGTH} characters"
        )
    binding_name = name if binding is None else binding
    if (
        not isinstance(binding_name, str)
        or not _NAME_RE.match(binding_name)
        or len(binding_name) > MAX_BINDING_LENGTH
    ):
        # As strict as family names: a binding is a database key and appears in logs and lease
        # keys, where NUL, newlines or spaces would corrupt or forge lines.
        raise ConfigError(
            f"family {name!r}: binding {binding_name!r:.80} must be lowercase words joined by "
            f"'-' or '_' (e.g. 'topic-memory'), at most {MAX_BINDING_LENGTH} characters"
        )
    cfg_prefix = default_prefix(name) if prefix is None else prefix
    if not isinstance(cfg_prefix, str) or not _PREFIX_RE.match(cfg_prefix):
        raise ConfigError(
            f"family {name!r}: prefix {cfg_prefix!r} must be upper-case letters, digits and '_'"
        )
    policy = make_policy(name, interval, cron, timezone)
    _check_budget(name, max_workers, timeout)
    target = default_registry if registry is None else registry

    def decorate(fn: Processor) -> Family:
        _check_processor(name, fn)
        fam = Family(
            name=name,
            binding_name=binding_name,
            prefix=cfg_prefix,
            policy=policy,
            max_workers=max_workers,
            timeout=float(timeout),
            entry_point=f"{fn.__module__}:{fn.__qualname__}",
            processor=fn,
            log_exception_messages=bool(log_exception_messages),
        )
        return target.add(fam)

    return decorate
