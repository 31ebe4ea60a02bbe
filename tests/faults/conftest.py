"""The fault tests drive real hosts with the acceptance tests' fixtures (not a copy of them)."""

from tests.acceptance.conftest import Hosts, hosts, store

__all__ = ["Hosts", "hosts", "store"]
