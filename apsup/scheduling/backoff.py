"""Failure backoff (RFC §7): exponential with slight jitter, capped, without a retry limit."""

from __future__ import annotations

import random
from dataclasses import dataclass

from apsup.errors import ConfigError


@dataclass(frozen=True)
class Backoff:
    """``base * factor**(failures-1)`` seconds, capped at ``cap``, times a jitter in
    ``[1 - jitter, 1 + jitter]``.

    The defaults give about 30 s, 1 min, 2 min, ... up to about 30 min. The jitter comes from the
    caller's ``rng`` so the simulation stays reproducible and many keys that failed together do
    not retry in lockstep.
    """

    base: float = 30.0
    factor: float = 2.0
    cap: float = 1800.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.factor >= 1 and self.cap >= self.base):
            raise ConfigError(f"invalid backoff {self!r}: need base > 0, factor >= 1, cap >= base")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"invalid backoff jitter {self.jitter!r}: need 0 <= jitter < 1")

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (``failures >= 1``);
        without ``rng`` (a single waiter, nothing to spread out) the delay has no jitter."""
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        exponent = min(failures - 1, 64)  # the cap is reached long before; avoids overflow
        raw = min(self.cap, self.base * self.factor**exponent)
        if rng is None:
            return raw
        return raw * rng.uniform(1 - self.jitter, 1 + self.jitter)
