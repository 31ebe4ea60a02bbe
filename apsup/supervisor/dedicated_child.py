"""The child side of dedicated mode: one family's Supervisor process, started by
``apsup.supervisor.dedicated.DedicatedLauncher`` as ``python -m apsup.supervisor.dedicated_child``.

It rebuilds the registry from the families' entry points, reloads the settings from the
environment the launcher wrote for it, and runs one host for its family through the Runtime.
Kept apart from the launcher so that the launcher never imports the Runtime that starts it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apsup.config import Settings
from apsup.errors import ConfigError
from apsup.registry import Family, Registry, resolve_entry_point
from apsup.scheduling import Backoff
from apsup.supervisor.dedicated import EXIT_CONFIG, MODULE
from apsup.supervisor.process import configure_logs, signals
from apsup.supervisor.runtime import Runtime


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM this process when the launcher dies; exit now if it is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        pass
    if parent and os.getppid() != parent:
        raise SystemExit(0)  # reparented before prctl took effect: the launcher is gone


def _parse_backoff(text: str | None) -> Backoff | None:
    if not text:
        return None
    base, factor, cap, jitter = (float(x) for x in text.split(":"))
    return Backoff(base=base, factor=factor, cap=cap, jitter=jitter)


def _build_registry(entries: Sequence[str]) -> Registry:
    registry = Registry()
    for entry in entries:
        registry.add(resolve_entry_point(entry))
    return registry


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=MODULE, description="one family's Supervisor process")
    parser.add_argument("--family", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--entry", action="append", default=[], required=True)
    parser.add_argument("--parent", type=int, default=0)
    parser.add_argument("--port-file")
    parser.add_argument("--backoff")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)

    try:
        registry = _build_registry(args.entry)
        settings = Settings.load(registry, prefix=args.prefix)
        configure_logs(settings.log_format, settings.log_level)
        if args.family not in settings.families:
            registry.get(args.family)  # raises ConfigError naming the registered families
        fam: Family = settings.families[args.family]
        runtime = Runtime(settings, registry, backoff=_parse_backoff(args.backoff))
    except ConfigError as exc:
        print(f"apsup dedicated[{args.family}]: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    port_file = Path(args.port_file) if args.port_file else None

    def report_port() -> None:
        runtime.started.wait()
        port = runtime.http_port
        if port_file is not None and port is not None:
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(port))
            os.replace(tmp, port_file)

    threading.Thread(target=report_port, name="apsup-port-report", daemon=True).start()
    with signals(runtime.stop):
        runtime.run_host([fam], "dedicated")
    return 0


def _entry(argv: Sequence[str] | None = None) -> Any:  # pragma: no cover - process entry
    raise SystemExit(main(argv))


if __name__ == "__main__":  # pragma: no cover
    _entry()
