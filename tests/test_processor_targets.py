"""@family accepts only what a Worker can run to completion: a plain function or an ``async def``.

Anything else used to be accepted because it was callable, then misbehaved in the Worker: an
``async def`` was acknowledged without running; a generator "returns" at once without running
its body; a class is instantiated and dropped; a bound method carries the state of an instance
the forkserver built at import time. Registration refuses these with a ConfigError naming the
family and what to change, and registers nothing.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator
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
