"""The decorator and registry reject every bad registration at startup (RFC §1, acceptance 15).

Each test uses its own ``Registry()``; processors are defined at module level so that their
entry points are importable by name, as Workers need.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from apsup import ConfigError, Cron, Disabled, Family, Interval, Registry, family
from apsup.registry import resolve_entry_point


def proc(scope_id: str, ctx: Any) -> None:
    """A plain module-level processor."""


def other_proc(scope_id: str, ctx: Any) -> None:
    """Another plain module-level processor."""


GOOD = Registry()


@family("alpha", interval=60, registry=GOOD)
def alpha(scope_id: str, ctx: Any) -> None:
    """Registered at import: its entry point resolves."""


@family("beta-gamma", cron="0 2 * * *", timezone="Asia/Shanghai", registry=GOOD)
def beta(scope_id: str, ctx: Any) -> None:
    """Registered at import with a cron policy."""


def register(name: str, fn: Any = proc, **kwargs: Any) -> Family:
    kwargs.setdefault("registry", Registry())
    return family(name, **kwargs)(fn)


# -- records -------------------------------------------------------------------------------------


def test_defaults_and_entry_point() -> None:
    fam = register("topic-memory")
    assert (fam.name, fam.binding_name, fam.prefix) == (
        "topic-memory",
        "topic-memory",
        "TOPIC_MEMORY",
    )
    assert (fam.policy, fam.max_workers, fam.timeout) == (Disabled(), 4, 600.0)
    assert fam.entry_point == f"{__name__}:proc"
    assert alpha.policy == Interval(60)
    assert beta.policy == Cron("0 2 * * *", "Asia/Shanghai")


def test_registered_entry_points_resolve() -> None:
    GOOD.validate()
    assert resolve_entry_point(alpha.entry_point) is alpha
    assert GOOD.modules() == [__name__]


# -- collisions ----------------------------------------------------------------------------------


def test_duplicate_family() -> None:
    reg = Registry()
    register("alpha", registry=reg)
    with pytest.raises(ConfigError, match="family 'alpha' is registered twice"):
        register("alpha", other_proc, registry=reg, binding="other", prefix="OTHER")


def test_duplicate_binding() -> None:
    reg = Registry()
    register("alpha", registry=reg, binding="shared")
    with pytest.raises(ConfigError, match="binding 'shared' already belongs to family 'alpha'"):
        register("beta", other_proc, registry=reg, binding="shared")


def test_prefix_collision() -> None:
    reg = Registry()
    register("topic-memory", registry=reg)
    with pytest.raises(ConfigError, match="prefix 'TOPIC_MEMORY' collides with family"):
        register("topic_memory", other_proc, registry=reg)
    register("topic_memory", other_proc, registry=reg, prefix="TOPIC_MEMORY_V2")


# -- policy --------------------------------------------------------------------------------------


def test_interval_and_cron() -> None:
    with pytest.raises(ConfigError, match="'alpha': interval and cron are both set"):
        register("alpha", interval=60, cron="0 2 * * *", timezone="UTC")


@pytest.mark.parametrize("interval", [0, -1, 0.0])
def test_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(ConfigError, match=r"'alpha': field 'interval': interval must be > 0"):
        register("alpha", interval=interval)


def test_bad_cron() -> None:
    with pytest.raises(ConfigError, match="'alpha': invalid cron expression 'daily'"):
        register("alpha", cron="daily", timezone="UTC")


def test_bad_timezone() -> None:
    with pytest.raises(ConfigError, match="'alpha': unknown IANA timezone 'Mars/Olympus'"):
        register("alpha", cron="0 2 * * *", timezone="Mars/Olympus")


def test_cron_needs_a_timezone() -> None:
    with pytest.raises(ConfigError, match="'alpha': cron needs an IANA timezone"):
        register("alpha", cron="0 2 * * *")


def test_timezone_without_cron() -> None:
    with pytest.raises(ConfigError, match="timezone is only meaningful with cron"):
        register("alpha", interval=60, timezone="UTC")


# -- budget --------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_workers", [0, -3, 1.5, True])
def test_max_workers_must_be_an_integer_of_at_least_one(max_workers: Any) -> None:
    with pytest.raises(ConfigError, match="'alpha': max_workers must be an integer >= 1"):
        register("alpha", max_workers=max_workers)


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(ConfigError, match="'alpha': timeout must be > 0 seconds"):
        register("alpha", timeout=timeout)


def test_with_overrides_keeps_the_budget_rules() -> None:
    fam = register("alpha")
    assert fam.with_overrides(max_workers=2).max_workers == 2
    with pytest.raises(ConfigError, match="max_workers must be an integer >= 1"):
        fam.with_overrides(max_workers=0)
    with pytest.raises(ConfigError, match="cannot override"):
        fam.with_overrides(name="beta")


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Topic", "topic memory", "-x", "", "a" * 65])
def test_bad_family_name(name: str) -> None:
    with pytest.raises(ConfigError, match="must be lowercase words"):
        register(name)


def test_bad_prefix() -> None:
    with pytest.raises(ConfigError, match="'alpha': prefix 'alpha' must be upper-case"):
        register("alpha", prefix="alpha")


# -- entry points --------------------------------------------------------------------------------


def test_processor_defined_inside_a_function_is_not_importable() -> None:
    def local(scope_id: str, ctx: Any) -> None:
        """Closures cannot be resolved by a Worker."""

    reg = Registry()
    register("alpha", local, registry=reg)
    with pytest.raises(ConfigError, match=r"'alpha'.*is not importable by name"):
        reg.validate()


def test_processor_in_main_is_not_importable() -> None:
    fn = types.FunctionType(proc.__code__, proc.__globals__, "main_proc")
    fn.__module__ = "__main__"
    fn.__qualname__ = "main_proc"
    reg = Registry()
    register("alpha", fn, registry=reg)
    with pytest.raises(ConfigError, match=r"'__main__:main_proc' is not importable by name"):
        reg.validate()


def test_entry_point_naming_a_plain_function_is_refused() -> None:
    reg = Registry()
    register("alpha", proc, registry=reg)  # module attribute `proc` stays a function
    with pytest.raises(ConfigError, match="does not name a @family-decorated processor"):
        reg.validate()


@pytest.mark.parametrize(
    "entry_point", ["no_such_module_xyz:fn", f"{__name__}:missing", f"{__name__}:alpha.nope"]
)
def test_entry_point_that_cannot_be_imported(entry_point: str) -> None:
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_entry_point(entry_point)


def test_entry_point_resolving_to_another_family() -> None:
    with pytest.raises(ConfigError, match="resolves to family 'alpha'"):
        resolve_entry_point(alpha.entry_point, expect=beta)


def test_empty_registry_fails_validation() -> None:
    with pytest.raises(ConfigError, match="no family is registered"):
        Registry().validate()


def test_reconciler_registered_twice() -> None:
    fam = register("alpha")
    fam.reconciler(lambda conn, f, token: None)
    with pytest.raises(ConfigError, match="reconciler registered twice"):
        fam.reconciler(lambda conn, f, token: None)


def test_unknown_family_lookup_lists_registered() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown family 'zeta' \(registered: alpha, beta-gamma\)"
    ):
        GOOD.get("zeta")
