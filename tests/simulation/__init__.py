"""Deterministic simulation of the scheduling core (see harness.py)."""
