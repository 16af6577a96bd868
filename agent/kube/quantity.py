"""Kubernetes quantities (``40Gi``, ``38654705664``, ``1.5G``, ``500M``) as exact byte counts.

The grammar is apimachinery's ``resource.Quantity`` (k8s.io/apimachinery ``pkg/api/resource/quantity.go``):
a signed decimal number, then a binary suffix (``Ki`` … ``Ei``), a decimal suffix (``k``, ``M``,
``G``, ``T``, ``P``, ``E``, ``m``) or a decimal exponent (``e3``, ``E3``). What comes from the API
server is untrusted: the text is bounded, the value must be a whole number of bytes within
:data:`MAX_VALUE`, and anything else is a :class:`ValueError` naming the text (cut short).
"""

from __future__ import annotations

import re
from fractions import Fraction

#: longer text is not a quantity the API server writes
MAX_TEXT = 64
#: 2^63 - 1: Kubernetes quantities of bytes fit an int64
MAX_VALUE = 2**63 - 1

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6)}
_DECIMAL |= {"G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18)}
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(?:(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|)|[eE]([+-]?\d{1,2}))")


def parse_bytes(text: str) -> int:
    """``text`` as a whole, non-negative number of bytes; ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"quantity {text!r:.32}: not a string")
    shown = text if len(text) <= 32 else text[:29] + "..."
    if len(text) > MAX_TEXT:
        raise ValueError(f"quantity {shown!r}: not a quantity")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"quantity {shown!r}: not a quantity")
    sign, number, suffix, exponent = match.groups()
    value = Fraction(number)
    if exponent is not None:
        value *= Fraction(10) ** int(exponent)
    elif suffix in _BINARY:
        value *= _BINARY[suffix]
    else:
        value *= _DECIMAL[suffix or ""]
    if sign == "-" and value:
        raise ValueError(f"quantity {shown!r}: negative")
    if value.denominator != 1:
        raise ValueError(f"quantity {shown!r}: not a whole number of bytes")
    if value > MAX_VALUE:
        raise ValueError(f"quantity {shown!r}: too large")
    return int(value)
