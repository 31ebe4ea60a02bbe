"""``apsup trigger --app tests.acceptance.cli_app``: puts the acceptance family ``acc-manual``
into the default registry, which is what the CLI reads. Only CLI subprocesses import this
module, so the test process's default registry stays untouched."""

from __future__ import annotations

from apsup.registry import default_registry
from tests.acceptance.families import acc_manual

if acc_manual.name not in default_registry:
    default_registry.add(acc_manual)
