from __future__ import annotations

from agent.base.backoff import Backoff


def test_delays_grow_and_cap() -> None:
    backoff = Backoff(initial_s=0.2, factor=2.0, max_s=30.0, jitter=0.0)
    assert [backoff.delay(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
    assert backoff.delay(20) == 30.0


def test_backoff_survives_a_long_outage() -> None:
    backoff = Backoff(initial_s=0.2, max_s=30.0, jitter=0.0)
    assert backoff.delay(100_000) == 30.0  # no OverflowError after days of retries


def test_jitter_stays_within_bounds() -> None:
    backoff = Backoff(initial_s=1.0, max_s=1.0, jitter=0.1)
    assert all(0.9 <= backoff.delay(5) <= 1.1 for _ in range(100))
