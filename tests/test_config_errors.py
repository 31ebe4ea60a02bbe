"""Acceptance 15: every bad configuration is a diagnosable startup outcome (RFC §10, §11).

Each test feeds an explicit environment mapping to ``Settings.load`` and asserts the message
names the variable(s) and says what to change. No database is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apsup import ConfigError, Cron, Disabled, Interval, Registry, family
from apsup.config import DEFAULT_PREFIX, InvalidSettings, Settings

P = DEFAULT_PREFIX
MYSQL = "mysql+pymysql://u:s3cret@h/db"

REG = Registry()


@family("memory", interval=60, registry=REG)
def memory(scope_id: str, ctx: object) -> None:
    """Test processor."""


@family("topic-memory", interval=300, max_workers=4, timeout=600, registry=REG)
def topic_memory(scope_id: str, ctx: object) -> None:
    """Test processor."""


@family("experience", interval=900, max_workers=2, timeout=120, registry=REG)
def experience(scope_id: str, ctx: object) -> None:
    """Test processor."""


@family("profile", cron="0 2 * * *", timezone="Asia/Shanghai", max_workers=1, registry=REG)
def profile(scope_id: str, ctx: object) -> None:
    """Test processor."""


@family("skill", registry=REG)  # no policy: automatic admission disabled
def skill(scope_id: str, ctx: object) -> None:
    """Test processor."""


# Only Topic Memory: the legacy aliases of other families target missing capabilities here.
TOPIC_ONLY = Registry()


@family("topic-memory", interval=300, registry=TOPIC_ONLY)
def topic_only(scope_id: str, ctx: object) -> None:
    """Test processor."""


RESERVED = Registry()


@family("artifact-processing", interval=60, registry=RESERVED)
def reserved(scope_id: str, ctx: object) -> None:
    """Test processor."""


def load(registry: Registry = REG, **variables: str) -> Settings:
    return Settings.load(registry, env={P + k: v for k, v in variables.items()})


def fails(registry: Registry = REG, **variables: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(registry, **variables)
    message = str(info.value)
    assert "s3cret" not in message
    return message


# -- defaults -------------------------------------------------------------------------------------


def test_defaults_come_from_the_decorator_and_documented_defaults() -> None:
    s = load()
    assert (s.mode, s.role, s.backend) == ("global", "all", "sqlite")
    assert s.database_url == f"sqlite:///{Path.cwd() / 'var' / 'apsup.db'}"
    assert (s.http_host, s.http_port) == ("127.0.0.1", 0)  # on by default, any free port
    assert (s.lease_seconds, s.renew_seconds, s.poll_seconds) == (15.0, 5.0, 2.0)
    assert (s.shutdown_grace_seconds, s.log_format, s.log_level) == (10.0, "auto", "INFO")
    assert s.families["topic-memory"].policy == Interval(300)
    assert s.families["profile"].policy == Cron("0 2 * * *", "Asia/Shanghai")
    assert s.families["skill"].policy == Disabled()
    assert s.sources["families.topic-memory.max_workers"] == "decorator"
    assert s.sources["mode"] == "default"
    assert s.aliases_in_use == []
    assert s.supervisor_keys() == ["global"]


def test_environment_overrides_decorator_and_records_the_source() -> None:
    s = load(
        TOPIC_MEMORY_SCHEDULE_SECONDS="120",
        TOPIC_MEMORY_MAX_WORKERS="8",
        TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS="30.5",
        ARTIFACT_PROCESSING_SUPERVISOR_MODE="Dedicated",
    )
    fam = s.families["topic-memory"]
    assert (fam.policy, fam.max_workers, fam.timeout) == (Interval(120), 8, 30.5)
    assert s.sources["families.topic-memory.max_workers"] == P + "TOPIC_MEMORY_MAX_WORKERS"
    assert s.mode == "dedicated"
    assert s.supervisor_keys() == [f"artifact:{n}" for n in sorted(REG_NAMES)]


REG_NAMES = {"memory", "topic-memory", "experience", "profile", "skill"}


def test_empty_values_count_as_unset() -> None:
    s = load(TOPIC_MEMORY_MAX_WORKERS="", ARTIFACT_PROCESSING_ROLE="  ")
    assert s.families["topic-memory"].max_workers == 4
    assert s.role == "all"


# -- mode, role, database -------------------------------------------------------------------------


def test_unknown_mode() -> None:
    msg = fails(ARTIFACT_PROCESSING_SUPERVISOR_MODE="grouped")
    assert P + "ARTIFACT_PROCESSING_SUPERVISOR_MODE" in msg
    assert "global | dedicated" in msg and "'grouped'" in msg


def test_unknown_role() -> None:
    msg = fails(ARTIFACT_PROCESSING_ROLE="worker")
    assert P + "ARTIFACT_PROCESSING_ROLE" in msg
    assert "all | api | background" in msg


@pytest.mark.parametrize("role", ["api", "background"])
def test_sqlite_accepts_only_role_all(role: str) -> None:
    msg = fails(ARTIFACT_PROCESSING_ROLE=role)
    assert P + "ARTIFACT_PROCESSING_ROLE" in msg and "SQLite" in msg
    assert f"{P}ARTIFACT_PROCESSING_ROLE=all" in msg and "MySQL" in msg


def test_mysql_accepts_every_role() -> None:
    assert load(DATABASE_URL=MYSQL, ARTIFACT_PROCESSING_ROLE="api").role == "api"


def test_in_memory_sqlite_is_refused() -> None:
    msg = fails(DATABASE_URL="sqlite://")
    assert P + "DATABASE_URL" in msg and "in-memory" in msg


def test_relative_sqlite_path_is_made_absolute() -> None:
    assert load(DATABASE_URL="sqlite:///rel/x.db").database_url == (
        f"sqlite:///{Path.cwd() / 'rel' / 'x.db'}"
    )


def test_unsupported_backend_is_refused_without_the_password() -> None:
    msg = fails(DATABASE_URL="mssql+pyodbc://u:s3cret@h/db")
    assert P + "DATABASE_URL" in msg and "unsupported database backend" in msg


def test_database_url_alone_for_migrate() -> None:
    env = {P + "DATABASE_URL": MYSQL, P + "ARTIFACT_PROCESSING_ROLE": "api"}
    assert Settings.database_url_from_env(env) == MYSQL
    with pytest.raises(ConfigError, match="DATABASE_URL"):
        Settings.database_url_from_env({P + "DATABASE_URL": "oracle://h/db"})


# -- numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("LEASE_SECONDS", "fifteen", "a number of seconds > 0"),
        ("POLL_SECONDS", "nan", "a number of seconds > 0"),
        ("HTTP_PORT", "http", "an integer port 0-65535"),
        ("TOPIC_MEMORY_MAX_WORKERS", "four", "an integer >= 1"),
        ("TOPIC_MEMORY_MAX_WORKERS", "2.5", "an integer >= 1"),
        ("TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS", "10m", "a number of seconds > 0"),
        ("EXPERIENCE_SCHEDULE_SECONDS", "15min", "a number of seconds >= 0 (0 disables"),
        ("PROFILE_SCHEDULE_ENABLED", "maybe", "true or false"),
    ],
)
def test_non_numeric_values_name_the_variable(name: str, value: str, expected: str) -> None:
    msg = fails(**{name: value})
    assert f"{P}{name}: expected {expected}" in msg and f"got {value!r}" in msg


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("HTTP_PORT", "70000", "an integer port 0-65535"),
        ("HTTP_PORT", "-1", "an integer port 0-65535"),
        ("LEASE_SECONDS", "0", "a number of seconds > 0"),
        ("LEASE_SECONDS", "inf", "a number of seconds > 0"),
        ("SHUTDOWN_GRACE_SECONDS", "-1", "a number of seconds >= 0"),
        ("TOPIC_MEMORY_MAX_WORKERS", "0", "an integer >= 1"),
        ("TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS", "0", "a number of seconds > 0"),
        ("TOPIC_MEMORY_SCHEDULE_SECONDS", "-5", "a number of seconds >= 0 (0 disables"),
    ],
)
def test_out_of_range_values_name_the_variable(name: str, value: str, expected: str) -> None:
    msg = fails(**{name: value})
    assert f"{P}{name}: expected {expected}" in msg


def test_renew_must_be_shorter_than_lease() -> None:
    msg = fails(LEASE_SECONDS="10", RENEW_SECONDS="10")
    assert P + "RENEW_SECONDS" in msg and "shorter than LEASE_SECONDS" in msg
    assert load(LEASE_SECONDS="9").renew_seconds == 3.0


def test_every_problem_is_reported_together() -> None:
    with pytest.raises(InvalidSettings) as info:
        load(
            ARTIFACT_PROCESSING_SUPERVISOR_MODE="x",
            LEASE_SECONDS="x",
            TOPIC_MEMORY_MAX_WORKERS="x",
            HANDOFF_CRON="0 * * * *",
        )
    assert len(info.value.problems) == 4
    assert "4 problems" in str(info.value)


# -- policies ------------------------------------------------------------------------------------


def test_interval_and_cron_for_the_same_family() -> None:
    msg = fails(
        EXPERIENCE_SCHEDULE_SECONDS="60", EXPERIENCE_CRON="0 * * * *", EXPERIENCE_TIMEZONE="UTC"
    )
    assert P + "EXPERIENCE_SCHEDULE_SECONDS" in msg and P + "EXPERIENCE_CRON" in msg
    assert "both set" in msg and "'experience'" in msg


def test_cron_without_timezone() -> None:
    msg = fails(SKILL_CRON="0 3 * * *")
    assert P + "SKILL_CRON" in msg and f"set {P}SKILL_TIMEZONE" in msg


def test_cron_without_timezone_keeps_the_decorator_timezone() -> None:
    s = load(PROFILE_CRON="30 4 * * *")
    assert s.families["profile"].policy == Cron("30 4 * * *", "Asia/Shanghai")
    assert s.sources["families.profile.policy"] == P + "PROFILE_CRON"


def test_timezone_alone_rezones_the_decorator_cron() -> None:
    assert load(PROFILE_TIMEZONE="UTC").families["profile"].policy == Cron("0 2 * * *", "UTC")


def test_timezone_without_a_cron_policy() -> None:
    msg = fails(EXPERIENCE_TIMEZONE="UTC")
    assert P + "EXPERIENCE_TIMEZONE" in msg and "only applies to a cron policy" in msg


def test_bad_cron() -> None:
    msg = fails(PROFILE_CRON="every day")
    assert P + "PROFILE_CRON" in msg and "invalid cron expression 'every day'" in msg


def test_unknown_timezone() -> None:
    msg = fails(PROFILE_TIMEZONE="Mars/Olympus")
    assert P + "PROFILE_TIMEZONE" in msg and "unknown IANA timezone 'Mars/Olympus'" in msg


def test_interval_replaces_a_decorator_cron() -> None:
    assert load(PROFILE_SCHEDULE_SECONDS="60").families["profile"].policy == Interval(60)


def test_schedule_enabled_false_disables() -> None:
    s = load(PROFILE_SCHEDULE_ENABLED="false", TOPIC_MEMORY_SCHEDULE_ENABLED="no")
    assert s.families["profile"].policy == Disabled()
    assert s.families["topic-memory"].policy == Disabled()
    assert s.sources["families.profile.policy"] == P + "PROFILE_SCHEDULE_ENABLED"
    assert (
        load(PROFILE_SCHEDULE_ENABLED="1").families["profile"].policy == REG.get("profile").policy
    )


def test_schedule_enabled_true_without_a_policy() -> None:
    msg = fails(SKILL_SCHEDULE_ENABLED="true")
    assert P + "SKILL_SCHEDULE_ENABLED" in msg and "no interval or cron" in msg


def test_schedule_seconds_zero_disables() -> None:
    s = load(TOPIC_MEMORY_SCHEDULE_SECONDS="0", EXPERIENCE_SCHEDULE_SECONDS="0.0")
    assert s.families["topic-memory"].policy == Disabled()
    assert s.families["experience"].policy == Disabled()


# -- names ---------------------------------------------------------------------------------------


def test_config_for_a_prefix_with_no_registered_family() -> None:
    msg = fails(HANDOFF_MAX_WORKERS="2")
    assert P + "HANDOFF_MAX_WORKERS" in msg and "missing capability" in msg
    assert "registered prefixes: EXPERIENCE, MEMORY, PROFILE, SKILL, TOPIC_MEMORY" in msg


def test_misspelt_family_prefix_suggests_the_registered_one() -> None:
    msg = fails(TOPIC_MEMROY_MAX_WORKERS="2")
    assert f"did you mean {P}TOPIC_MEMORY_MAX_WORKERS?" in msg


def test_unknown_variable_is_rejected_with_a_hint() -> None:
    msg = fails(LEASE_SECOND="10")
    assert P + "LEASE_SECOND: unknown setting" in msg
    assert f"did you mean {P}LEASE_SECONDS?" in msg and "IGNORE_KEYS" in msg


def test_near_miss_of_a_family_key_is_rejected() -> None:
    msg = fails(TOPIC_MEMORY_MAX_WORKER="2")
    assert f"did you mean {P}TOPIC_MEMORY_MAX_WORKERS?" in msg


def test_max_concurrency_is_only_profiles_alias() -> None:
    msg = fails(EXPERIENCE_MAX_CONCURRENCY="2")
    assert f"not a setting of family 'experience'; did you mean {P}EXPERIENCE_MAX_WORKERS?" in msg


@pytest.mark.parametrize("name", ["METRICS_PORT", "HEALTH_PORT", "METRICS_HOST", "HEALTH_HOST"])
def test_separate_metrics_and_health_listeners_point_to_http(name: str) -> None:
    msg = fails(**{name: "9100"})
    assert P + name in msg and P + "HTTP_" in msg


def test_ignore_keys_skips_foreign_variables_but_never_apsup_ones() -> None:
    s = load(IGNORE_KEYS="SIDECAR_*, HANDOFF_CRON", SIDECAR_URL="x", HANDOFF_CRON="0 * * * *")
    assert s.ignored == [P + "HANDOFF_CRON", P + "SIDECAR_URL"]
    assert s.effective_report()["ignored_variables"] == s.ignored
    msg = fails(IGNORE_KEYS="TOPIC_MEMORY_*", TOPIC_MEMORY_MAX_WORKERS="0")
    assert P + "TOPIC_MEMORY_MAX_WORKERS" in msg


def test_family_prefix_reserved_for_runtime_settings() -> None:
    msg = fails(RESERVED)
    assert "'artifact-processing'" in msg and "reserved" in msg


def test_family_own_settings_reach_its_workers_without_secrets() -> None:
    s = load(TOPIC_MEMORY_WINDOW_SOURCES="5", TOPIC_MEMORY_API_KEY="sk-1", EXPERIENCE_MODEL="m")
    env = s.worker_env("topic-memory")
    assert env[P + "TOPIC_MEMORY_WINDOW_SOURCES"] == "5"
    assert env[P + "TOPIC_MEMORY_MAX_WORKERS"] == "4"
    assert P + "EXPERIENCE_MODEL" not in env
    assert not any("KEY" in k or "URL" in k for k in env)
    report = s.effective_report()["families"]["topic-memory"]["settings"]
    assert report == {"TOPIC_MEMORY_API_KEY": "<redacted>", "TOPIC_MEMORY_WINDOW_SOURCES": "5"}


def test_worker_env_round_trips_through_load() -> None:
    s = load(
        TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS="0.1", ARTIFACT_PROCESSING_SUPERVISOR_MODE="dedicated"
    )
    again = Settings.load(REG, env=s.worker_env())
    assert again.families["topic-memory"].timeout == 0.1
    assert again.mode == "dedicated"


# -- compatibility aliases (RFC §11) --------------------------------------------------------------

ALIAS_CASES = [
    ("SCHEDULE_SECONDS", "MEMORY_SCHEDULE_SECONDS", "memory", "policy", "120", Interval(120)),
    ("PROFILE_MAX_CONCURRENCY", "PROFILE_MAX_WORKERS", "profile", "max_workers", "3", 3),
    (
        "ARTIFACT_PROCESSING_MAX_WORKERS",
        "TOPIC_MEMORY_MAX_WORKERS",
        "topic-memory",
        "max_workers",
        "9",
        9,
    ),
    (
        "ARTIFACT_PROCESSING_WORKER_TIMEOUT_SECONDS",
        "TOPIC_MEMORY_WORKER_TIMEOUT_SECONDS",
        "topic-memory",
        "timeout",
        "900",
        900.0,
    ),
]
ALIAS_IDS = [c[0] for c in ALIAS_CASES]


@pytest.mark.parametrize(
    ("old", "new", "fam", "attr", "value", "expected"), ALIAS_CASES, ids=ALIAS_IDS
)
def test_alias_alone_works_and_is_reported(
    old: str, new: str, fam: str, attr: str, value: str, expected: object
) -> None:
    s = load(**{old: value})
    assert getattr(s.families[fam], attr) == expected
    assert s.aliases_in_use == [f"{P}{old} -> {P}{new}"]
    assert s.effective_report()["aliases_in_use"] == s.aliases_in_use
    assert s.sources[f"families.{fam}.{'policy' if attr == 'policy' else attr}"] == P + old


@pytest.mark.parametrize(
    ("old", "new", "fam", "attr", "value", "expected"), ALIAS_CASES, ids=ALIAS_IDS
)
def test_alias_conflicting_with_the_new_key_fails_naming_both(
    old: str, new: str, fam: str, attr: str, value: str, expected: object
) -> None:
    msg = fails(**{old: value, new: "7"})
    assert P + old in msg and P + new in msg and "disagree" in msg


@pytest.mark.parametrize(
    ("old", "new", "fam", "attr", "value", "expected"), ALIAS_CASES, ids=ALIAS_IDS
)
def test_alias_equal_to_the_new_key_works_and_is_reported(
    old: str, new: str, fam: str, attr: str, value: str, expected: object
) -> None:
    s = load(**{old: value, new: value + ".0" if attr == "timeout" else value})
    assert getattr(s.families[fam], attr) == expected
    assert s.aliases_in_use == [f"{P}{old} -> {P}{new}"]
    assert s.sources[f"families.{fam}.{attr}"] == P + new


@pytest.mark.parametrize("old", ["SCHEDULE_SECONDS", "PROFILE_MAX_CONCURRENCY"])
def test_alias_for_an_unregistered_family_is_a_missing_capability(old: str) -> None:
    msg = fails(TOPIC_ONLY, **{old: "2"})
    assert P + old in msg and "missing capability" in msg


def test_legacy_schedule_seconds_zero_disables_memory() -> None:
    assert load(SCHEDULE_SECONDS="0").families["memory"].policy == Disabled()


def test_artifact_processing_budget_applies_to_topic_memory_only() -> None:
    s = load(ARTIFACT_PROCESSING_MAX_WORKERS="16", ARTIFACT_PROCESSING_WORKER_TIMEOUT_SECONDS="30")
    assert (s.families["topic-memory"].max_workers, s.families["topic-memory"].timeout) == (16, 30)
    assert (s.families["experience"].max_workers, s.families["experience"].timeout) == (2, 120)
    assert s.families["memory"].max_workers == 4
    assert s.families["profile"].max_workers == 1


# -- redaction -----------------------------------------------------------------------------------


def test_effective_report_redacts_the_database_password() -> None:
    s = load(DATABASE_URL=MYSQL, ARTIFACT_PROCESSING_ROLE="background")
    text = json.dumps(s.effective_report())
    assert "s3cret" not in text
    database = s.effective_report()["database"]
    assert database == "mysql+pymysql://h/db"  # credentials are dropped, not masked
    assert ":u@" not in database and "//u:" not in database
    assert "s3cret" not in repr(s)
    assert not any("s3cret" in v for v in s.worker_env().values())


def test_errors_never_show_the_database_password() -> None:
    # fails() asserts the password is absent from every message.
    fails(DATABASE_URL=MYSQL, ARTIFACT_PROCESSING_SUPERVISOR_MODE="bad")
    fails(DATABASE_URL="mysql+pymysql://u:s3cret@h:notaport/db")
    fails(HTTP_HOST=MYSQL)  # a DSN pasted into the wrong variable is still masked
    fails(DATABSE_URL=MYSQL)  # a misspelt name: the value is never echoed


def test_the_console_credential_is_checked_and_never_quoted(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-console-token-0123456789\n")
    assert load(CONSOLE_TOKEN_FILE=str(token)).console_token == "s3cret-console-token-0123456789"
    assert load().console_token is None and load().effective_report()["console_actions"] == "off"
    s = load(CONSOLE_TOKEN="s3cret-console-token-0123456789")
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.effective_report())
    assert s.effective_report()["console_actions"] == "on"
    assert not any("CONSOLE_TOKEN" in k for k in s.worker_env())  # never passed to Workers
    assert "at least 16 characters" in fails(CONSOLE_TOKEN="s3cret")
    short = tmp_path / "short"
    short.write_text("s3cret\n")
    assert "CONSOLE_TOKEN_FILE" in fails(CONSOLE_TOKEN_FILE=str(short))
    assert "cannot read" in fails(CONSOLE_TOKEN_FILE=str(tmp_path / "missing"))
    both = fails(CONSOLE_TOKEN_FILE=str(token), CONSOLE_TOKEN="s3cret-console-token-0123456789")
    assert "not both" in both


def test_tools_read_the_lease_and_console_token_through_the_catalogue(tmp_path) -> None:
    """``apsup status`` judges membership rows by the replicas' Lease and sends their console
    token: both read through the configuration, with its checks and its messages."""
    from apsup.config import DEFAULT_PREFIX, InvalidSettings, Settings

    lease = DEFAULT_PREFIX + "LEASE_SECONDS"
    assert Settings.lease_seconds_from_env({}) == 15.0
    assert Settings.lease_seconds_from_env({lease: "4.5"}) == 4.5
    with pytest.raises(InvalidSettings, match="LEASE_SECONDS: expected a number of seconds"):
        Settings.lease_seconds_from_env({lease: "soon"})
    token = tmp_path / "token"
    token.write_text("t" * 20 + "\n")
    assert Settings.console_token_from_env({DEFAULT_PREFIX + "CONSOLE_TOKEN_FILE": str(token)})
    assert Settings.console_token_from_env({}) is None
    with pytest.raises(InvalidSettings, match="at least 16 characters"):
        Settings.console_token_from_env({DEFAULT_PREFIX + "CONSOLE_TOKEN": "short"})
