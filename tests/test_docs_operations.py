"""docs/operations.md documents every environment variable ``apsup/config.py`` accepts, with the
default the code really uses, and the reference families' own settings with theirs. A failure
prints the rows to add."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from apsup.config import ALIASES, FAMILY_KEYS, GLOBAL_KEYS, MODE, ROLE, Settings
from apsup.families import experience, handoff, profile, topic_memory
from apsup.registry import Registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
ROW = re.compile(r"^\| `([A-Z0-9_<>]+)` \| (.*?) \| (.*) \|$")


def documented() -> dict[str, str]:
    """{variable: default cell} of every table row naming a variable."""
    rows = (ROW.match(line) for line in DOC.read_text().splitlines())
    return {m.group(1): m.group(2) for m in rows if m}


def test_every_variable_config_accepts_is_documented() -> None:
    rows = documented()
    expected = [*GLOBAL_KEYS, *(f"<PREFIX>_{k}" for k in FAMILY_KEYS), *(a.old for a in ALIASES)]
    missing = [name for name in expected if name not in rows]
    assert not missing, "add to docs/operations.md:\n" + "\n".join(
        f"| `{name}` | ? | ? |" for name in missing
    )


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def test_documented_defaults_are_the_defaults(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings.load(Registry(), env={})
    rows = documented()
    fields = {MODE: "mode", ROLE: "role"}
    checked = 0
    for name in GLOBAL_KEYS:
        cell = rows[name]
        if name == "DATABASE_URL":
            assert settings.database_url == f"sqlite:///{tmp_path / 'var' / 'apsup.db'}"
            assert "sqlite:///./var/apsup.db" in cell
        elif name == "RENEW_SECONDS":
            assert settings.renew_seconds == settings.lease_seconds / 3
            assert "LEASE_SECONDS / 3" in cell
        elif name == "RENEW_DEADLINE_SECONDS":
            assert settings.renew_deadline_seconds == settings.lease_seconds * 2 / 3
            assert "LEASE_SECONDS x 2/3" in cell
        elif name in ("CONSOLE_TOKEN", "CONSOLE_TOKEN_FILE"):
            assert settings.console_token is None and cell.startswith("unset"), (name, cell)
        elif name == "IGNORE_KEYS":
            assert settings.ignored == [] and cell.startswith("unset")
        else:
            value = getattr(settings, fields.get(name, name.lower()))
            if value is None:
                assert cell.startswith("unset"), (name, cell)
            else:
                assert cell.startswith(f"`{_shown(value)}`"), (name, cell, value)
        checked += 1
    assert checked == len(GLOBAL_KEYS)


def test_reference_family_settings_are_documented_with_their_defaults() -> None:
    rows = documented()
    expected = {
        "TOPIC_MEMORY_WINDOW_SOURCES": topic_memory.WINDOW_SOURCES,
        "TOPIC_MEMORY_WINDOW_BYTES": topic_memory.WINDOW_BYTES,
        "TOPIC_MEMORY_WINDOWS_PER_INVOCATION": topic_memory.WINDOWS_PER_INVOCATION,
        "EXPERIENCE_BATCH_ITEMS": experience.BATCH_ITEMS,
        "PROFILE_MAX_SOURCES": profile.MAX_SOURCES,
        "HANDOFF_PAGE": handoff.PAGE,
    }
    for name, default in expected.items():
        assert rows.get(name) == f"`{default}`", (name, rows.get(name), default)
    # ...and no reference family reads a setting this table does not list.
    sources = "\n".join(
        Path(m.__file__).read_text() for m in (topic_memory, experience, profile, handoff)
    )  # type: ignore[arg-type]
    read = re.findall(r'int_setting\(ctx, PREFIX, "([A-Z_]+)"', sources)
    prefixes = {
        "WINDOW_SOURCES": "TOPIC_MEMORY",
        "WINDOW_BYTES": "TOPIC_MEMORY",
        "WINDOWS_PER_INVOCATION": "TOPIC_MEMORY",
        "BATCH_ITEMS": "EXPERIENCE",
        "MAX_SOURCES": "PROFILE",
        "PAGE": "HANDOFF",
    }
    assert {f"{prefixes.get(k, '?')}_{k}" for k in read} <= set(expected), read
