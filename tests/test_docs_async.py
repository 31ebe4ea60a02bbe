"""docs/async.md runs as written, on both backends, with a real host and real Workers.

Python blocks whose first line is ``# notes_app.py`` (or ``# notes_app.py (continued)``) make up
the module ``notes_app``, written to a temporary folder on ``PYTHONPATH`` so that the Worker
forkserver imports it by name, as it would an application's module. The other Python blocks run
in order in one namespace; after the block that accepts the requests, a real host (the
acceptance harness's ``LiveHost``: real Supervisor, forkserver and Worker processes) runs until
those requests are handled, then the remaining blocks check the outcome.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apsup.registry import default_registry
from apsup.store import SqlBackend, intents
from tests.acceptance.harness import LiveHost

pytestmark = pytest.mark.timeout(240)

DOC = Path(__file__).resolve().parents[1] / "docs" / "async.md"
MODULE = "notes_app"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> tuple[str, list[str]]:
    """(module source, script blocks in order) from the page."""
    module: list[str] = []
    scripts: list[str] = []
    for block in _BLOCK.findall(DOC.read_text(encoding="utf-8")):
        if block.startswith(f"# {MODULE}.py"):
            module.append(block)
        else:
            scripts.append(block)
    return "\n".join(module), scripts


def test_the_page_has_the_blocks_this_test_runs() -> None:
    module, scripts = blocks()
    assert "async def summarise_notes" in module and "async def accept" in module
    assert "fenced_async()" in module and "request_async" in module
    assert len(scripts) == 2 and "notes_app.accept" in scripts[0]


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(blocks()[0], encoding="utf-8")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        yield folder
    finally:
        sys.modules.pop(MODULE, None)
        default_registry._families.pop("note-summary", None)  # registered at import


def test_async_family_and_endpoint_run_as_documented(
    backend: SqlBackend, app_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POWERCONTEXT_SERVER_RUNTIME_DATABASE_URL", backend.url)
    accept_block, check_block = blocks()[1]
    namespace: dict[str, object] = {"__name__": "docs_async"}
    exec(compile(accept_block, f"{DOC}:accept", "exec"), namespace)

    import notes_app  # type: ignore[import-not-found]

    def done() -> bool:
        with backend.read() as conn:
            rows = [intents.get(conn, "note-summary", s) for s in ("scope-1", "scope-2")]
        return all(r is not None and r.handled_generation >= r.requested_generation for r in rows)

    assert not done()
    host = LiveHost(backend.url, [notes_app.summarise_notes])
    try:
        host.run_until(done, "the documented requests are handled")
    finally:
        host.close()
    exec(compile(check_block, f"{DOC}:check", "exec"), namespace)
