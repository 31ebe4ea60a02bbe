"""@family accepts only what a Worker can run to completion: a plain function or an ``async def``.

Anything else used to be accepted because it was callable, then misbehaved in the Worker: an
``async def`` was acknowledged without running; a generator "returns" at once without running
its body; a class is instantiated and dropped; a bound method carries the state of an instance
the forkserver built at import time. Registration refuses these with a ConfigError naming the
family and what to change, and registers nothing.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from apsup import ConfigError, Registry, family
from apsup.registry import resolve_entry_point


def plain(scope_id: str, ctx: Any) -> None:
    """A plain processor."""


async def coroutine_processor(scope_id: str, ctx: Any) -> None:
    """An async def processor."""


def generator_processor(scope_id: str, ctx: Any) -> Iterator[None]:
    yield None


async def async_generator_processor(scope_id: str, ctx: Any) -> AsyncIterator[None]:
    yield None


class ProcessorClass:
    def __init__(self, scope_id: str, ctx: Any) -> None:
        self.scope_id = scope_id

    def process(self, scope_id: str, ctx: Any) -> None:
        """Bound to an instance built at import time below."""

    def __call__(self, scope_id: str, ctx: Any) -> None:
        """Makes instances callable objects."""


BUILT_AT_IMPORT = ProcessorClass("import", None)

ASYNC_REGISTRY = Registry()


@family("async-ok", interval=60, registry=ASYNC_REGISTRY)
async def async_ok(scope_id: str, ctx: Any) -> None:
    """Registered at import: an async def processor is a valid entry point."""


def test_plain_and_async_def_functions_are_accepted() -> None:
    reg = Registry()
    assert family("plain", registry=reg)(plain).processor is plain
    assert family("coro", registry=reg)(coroutine_processor).processor is coroutine_processor
    ASYNC_REGISTRY.validate()
    assert resolve_entry_point(async_ok.entry_point) is async_ok


@pytest.mark.parametrize(
    ("target", "kind", "change"),
    [
        (generator_processor, "a generator", "return instead of yield"),
        (async_generator_processor, "an async generator", "return instead of yield"),
        (ProcessorClass, "a class", "decorate a module-level function"),
        (BUILT_AT_IMPORT.process, "a bound method", "build the object it needs inside"),
        (BUILT_AT_IMPORT, "a callable ProcessorClass object", "decorate a def or async def"),
        (functools.partial(plain, "x"), "a callable partial object", "def or async def"),
        (print, "a callable builtin_function_or_method object", "def or async def"),
        ("plain", "a str", "def or async def"),
    ],
    ids=[
        "generator",
        "async-generator",
        "class",
        "bound-method",
        "callable",
        "partial",
        "builtin",
        "not-callable",
    ],
)
def test_anything_else_is_refused_with_the_family_and_the_fix(
    target: Any, kind: str, change: str
) -> None:
    reg = Registry()
    with pytest.raises(ConfigError) as info:
        family("alpha", registry=reg)(target)
    message = str(info.value)
    assert message.startswith(f"family 'alpha': the processor is {kind}, not a plain function")
    assert change in message and "\n" not in message
    assert len(reg) == 0  # nothing registered


def test_cli_reports_a_bad_processor_in_one_line_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "apsup_bad_generator_family.py").write_text(
        "from apsup import family\n\n\n"
        "@family('bad-gen', interval=60)\n"
        "def gen(scope_id, ctx):\n"
        "    yield 1\n"
    )
    db = tmp_path / "apsup.db"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "POWERCONTEXT_SERVER_RUNTIME_DATABASE_URL": f"sqlite:///{db}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "apsup.cli", "check-config", "--app", "apsup_bad_generator_family"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "family 'bad-gen': the processor is a generator" in line and "Traceback" not in line
    assert not db.exists()  # nothing created
