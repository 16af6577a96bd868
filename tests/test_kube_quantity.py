"""Kubernetes quantities from the API server, as whole bytes, and every malformed one refused."""

from __future__ import annotations

import pytest

from agent.kube.quantity import MAX_VALUE, parse_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40Gi", 40 << 30),
        ("38654705664", 38654705664),
        ("40G", 40 * 10**9),
        ("1.5Gi", 3 << 29),
        ("500M", 500 * 10**6),
        ("1e3", 1000),
        ("2E2", 200),
        ("0", 0),
        ("+8Ki", 8192),
        ("81559Mi", 81559 << 20),
        ("1500m", None),  # 1.5 bytes
    ],
)
def test_parses_what_the_api_writes(text: str, value: int | None) -> None:
    if value is None:
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "not a quantity"),
        ("lots", "not a quantity"),
        ("40 Gi", "not a quantity"),
        ("40GiB", "not a quantity"),
        ("1e999", "not a quantity"),  # exponent bounded to two digits
        ("9" * 65, "not a quantity"),  # the text is bounded
        ("-1Gi", "negative"),
        ("9Ei", "too large"),
        (str(MAX_VALUE + 1), "too large"),
        ("0.1", "not a whole number"),
    ],
)
def test_refuses_what_is_not_a_byte_count(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_bytes(text)


def test_a_non_string_is_refused() -> None:
    with pytest.raises(ValueError, match="not a string"):
        parse_bytes(40)  # type: ignore[arg-type]
