"""Retry delays shared by everything that reconnects (kubelet registration, API watches)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry ``attempt`` (1-based): exponential with jitter, capped."""

    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    jitter: float = 0.1

    def delay(self, attempt: int) -> float:
        # the exponent is capped before the power: a long outage must not overflow a float
        exponent = min(max(0, attempt - 1), 64)
        base = min(self.max_s, self.initial_s * self.factor**exponent)
        return base * (1 + random.uniform(-self.jitter, self.jitter))
