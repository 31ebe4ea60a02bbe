"""``--app`` module for CLI subprocess tests: puts the replica test families into the default
registry (imported only by the ``apsup`` subprocess, so the test process's default registry
stays clean)."""

from __future__ import annotations

from apsup.registry import default_registry
from tests.replicas import families

for _fam in families.registry:
    if _fam.name not in default_registry:
        default_registry.add(_fam)
