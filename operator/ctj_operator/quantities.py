"""Kubernetes resource quantities (``500m``, ``4Gi``, ``1e3``), exactly as the API server
parses them, and amounts in the base units the scheduler compares (resource.Quantity)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BYTES_RESOURCES = ("memory", "ephemeral-storage")
INT64_MAX = 2**63 - 1
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?P<suffix>[eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?"
)
_DECIMAL_EXPONENT = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15}
_DECIMAL_EXPONENT["E"] = 18  # a bare E; E followed by digits is an exponent
_BINARY_EXPONENT = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def parse_quantity(quantity: str | int | float) -> int | Fraction:
    """The exact value of a Kubernetes quantity: ``<number><suffix>``.

    The number is ``[+-]digits[.digits]`` (``1.``, ``.5`` included); the suffix is binary
    (Ki..Ei, powers of 1024), decimal (n u m, none, k M G T P E) or an exponent (``e3``,
    ``E-2``; a bare ``E`` is exa). Like resource.ParseQuantity, a non-zero value is rounded
    up (away from zero) to whole nanos. An int is returned when the value is whole.
    Malformed or beyond int64: ValueError naming the quantity.
    """
    if isinstance(quantity, bool) or not isinstance(quantity, str | int | float):
        raise ValueError(f"quantity {quantity!r} is not a string or a number")
    if isinstance(quantity, int):
        return _checked(Fraction(quantity), quantity)
    text = repr(quantity) if isinstance(quantity, float) else quantity
    m = _QUANTITY.fullmatch(text)
    if m is None or not (m["int"] or m["frac"]):
        raise ValueError(f"malformed quantity {quantity!r}")
    frac, suffix = m["frac"] or "", m["suffix"] or ""
    significant = (m["int"] + frac).lstrip("0")
    if len(significant) > 64 or len(suffix) > 12:  # no int64 quantity is written so long
        raise ValueError(f"quantity {quantity!r} is out of range")
    mantissa = int(significant or "0") * (-1 if m["sign"] == "-" else 1)
    if not mantissa:
        return 0
    if suffix in _BINARY_EXPONENT:
        value = Fraction(mantissa * 2 ** _BINARY_EXPONENT[suffix], 10 ** len(frac))
    else:
        exponent = _DECIMAL_EXPONENT.get(suffix)
        exponent = (int(suffix[1:]) if exponent is None else exponent) - len(frac)
        if exponent + len(significant) > 20:  # >= 10**20: no need to build it
            raise ValueError(f"quantity {quantity!r} is beyond int64")
        if exponent + len(significant) < -10:  # below one nano: rounds up to it
            value = Fraction(1 if mantissa > 0 else -1, 10**9)
        else:
            value = mantissa * Fraction(10) ** exponent
    return _checked(_round_up_to_nanos(value), quantity)


def _round_up_to_nanos(value: Fraction) -> Fraction:
    magnitude = Fraction(math.ceil(abs(value) * 10**9), 10**9)
    return magnitude if value >= 0 else -magnitude


def _checked(value: Fraction, quantity: object) -> int | Fraction:
    if abs(value) > INT64_MAX:
        raise ValueError(f"quantity {quantity!r} is beyond int64")
    return value.numerator if value.denominator == 1 else value


def base_units(resource: str, quantity: str | int | float | Fraction) -> int:
    """A quantity of ``resource`` in base units, rounded up as the scheduler does:
    cpu in millicores (Quantity.MilliValue), everything else whole (Quantity.Value)."""
    value = Fraction(quantity) if isinstance(quantity, Fraction) else parse_quantity(quantity)
    return math.ceil(value * 1000) if resource == "cpu" else math.ceil(value)


def format_amount(resource: str, amount: int) -> str:
    """``amount`` base units of ``resource`` for people: ``1500m``/``2`` cpu, ``512Mi``."""
    if resource == "cpu":
        return str(amount // 1000) if amount % 1000 == 0 else f"{amount}m"
    if (resource in _BYTES_RESOURCES or resource.startswith("hugepages-")) and amount:
        for suffix, exponent in reversed(_BINARY_EXPONENT.items()):
            if amount % 2**exponent == 0:
                return f"{amount // 2**exponent}{suffix}"
    return str(amount)
