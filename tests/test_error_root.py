"""Every error apsup raises on purpose is defined in ``apsup.errors``, under ``ApsupError``, so
one ``except ApsupError`` catches them all and one file lists them (stdlib bases kept, so an
``except ValueError`` or ``except TimeoutError`` written earlier still works).

Two stand-ins for a dying Worker are kept apart on purpose, and named here: catching them is
exactly what a processor must not be able to do by catching apsup's errors.
"""

from __future__ import annotations

import importlib
import inspect

from apsup import errors
from tests.test_no_import_cycles import _modules

#: Not errors but stand-ins for a Worker's end, which no ``except ApsupError`` may swallow.
APART = {
    "apsup.workers.child.WorkerTerminated",  # a BaseException, like KeyboardInterrupt
    "apsup.testing.SimulatedCrash",  # apsup.testing's crash in place of a killed Worker
}


def _defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        if name == "apsup.migrations.env" or name.startswith(
            ("apsup.migrations.", "apsup.families")
        ):
            continue
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not attr.startswith("_")
            ):
                found[f"{name}.{attr}"] = value
    return found


def test_every_public_error_is_in_errors_under_the_root() -> None:
    defined = _defined_exceptions()
    outside = sorted(k for k in defined if not k.startswith("apsup.errors.") and k not in APART)
    assert outside == [], "define these in apsup/errors.py (re-export them where they were)"
    in_errors = [v for k, v in defined.items() if k.startswith("apsup.errors.")]
    assert len(in_errors) >= 20
    assert [e.__name__ for e in in_errors if not issubclass(e, errors.ApsupError)] == []
    assert set(APART) <= set(defined)  # the allowance names what exists


def test_the_moved_errors_keep_their_bases_and_old_names() -> None:
    from apsup.config import InvalidSettings
    from apsup.observability.status_view import StatusUnavailable
    from apsup.operator import UnknownScope
    from apsup.store.revision import SchemaRevisionError
    from apsup.workers.pool import ForkServerStuck

    assert issubclass(ForkServerStuck, TimeoutError) and issubclass(UnknownScope, LookupError)
    assert issubclass(InvalidSettings, ValueError) and issubclass(SchemaRevisionError, ValueError)
    assert StatusUnavailable is errors.StatusUnavailable
    assert StatusUnavailable("x", 2).code == 2
