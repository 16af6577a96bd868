"""Compile and evaluate Kubernetes CEL (DeviceClass selectors, admission policies) with cel-python.

Kubernetes compiles these expressions with cel-go plus its own libraries; cel-python parses the
same grammar and evaluates with the same semantics (``&&``/``||`` absorb an error when the other
side decides, a missing map key is an error). What cel-python lacks is added here:

* the Kubernetes ``quantity`` and ``semver`` libraries (``quantity("80Gi")``, ``.compareTo``,
  ``.isGreaterThan``, ``semver("9.0.0")``, ``.major()``, ...), registered as functions;
* the DRA ``device`` variable: ``device.driver``, ``device.attributes[domain].name`` (ints,
  bools, strings, versions as semver values) and ``device.capacity[domain].name`` (quantities);
  an unknown domain is an empty map, as in the scheduler;
* a name check that plays the part of cel-go's type checker for what matters here: every
  function and every top-level variable an expression uses must exist in its environment, so a
  misspelt ``compareto`` fails at "compile" time instead of matching nothing.

Devices are plain dicts, ``{"driver": ..., "attributes": {domain: {name: value}}, "capacity":
{domain: {name: quantity string}}}``, where a value is a ResourceSlice ``DeviceAttribute``
(``{"version": "9.0.0"}``, ``{"int": 3}``, ...) or a plain bool, int or str (a string).
:func:`devices_from_resource_slice` turns a published ResourceSlice into that list.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import total_ordering
from typing import Any

import celpy
import lark
from celpy import celtypes

#: the API server's limit on one selector expression (resource.k8s.io validation)
MAX_EXPRESSION_BYTES = 10 * 1024

# --- Kubernetes quantities ---------------------------------------------------------------

_QUANTITY_RE = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))((?:[eE][+-]?[0-9]+)|[KMGTPE]i|[numkMGTPE]?)$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1}
_DECIMAL.update({"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18})


class CelValueError(ValueError):
    """A value a Kubernetes library function refuses (a malformed quantity or version)."""


@total_ordering
@dataclass(frozen=True, slots=True, eq=False)
class Quantity:
    """A Kubernetes resource quantity, exact (``80Gi``, ``81559Mi``, ``1.5G``, ``2e3``)."""

    value: Fraction
    text: str

    @classmethod
    def parse(cls, text: str) -> Quantity:
        match = _QUANTITY_RE.fullmatch(str(text).strip())
        if match is None:
            raise CelValueError(f"not a Kubernetes quantity: {str(text)[:40]!r}")
        number, suffix = Fraction(match.group(1)), match.group(2)
        if suffix[:1] in ("e", "E"):
            return cls(number * Fraction(10) ** int(suffix[1:]), str(text))
        factor = _BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix]
        return cls(number * factor, str(text))

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


@total_ordering
@dataclass(frozen=True, slots=True, eq=False)
class Semver:
    """A SemVer 2.0.0 version, ordered by precedence (build metadata ignored)."""

    major: int
    minor: int
    patch: int
    pre: tuple[int | str, ...]
    text: str

    _RE = re.compile(
        r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
        r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
        r"(?:\+[0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*)?$"
    )

    @classmethod
    def parse(cls, text: str) -> Semver:
        match = cls._RE.fullmatch(str(text))
        if match is None:
            raise CelValueError(f"not a semantic version: {str(text)[:40]!r}")
        pre = tuple(int(p) if p.isdigit() else p for p in match.group(4).split(".")) if match.group(4) else ()
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3)), pre, str(text))

    def _key(self) -> tuple[Any, ...]:
        # a release ranks above its pre-releases; numeric identifiers rank below alphanumeric ones
        pre = tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, 1 if not self.pre else 0, pre)

    def __lt__(self, other: Semver) -> bool:
        return self._key() < other._key()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _same_kind(a: Any, b: Any, name: str) -> None:
    if not (isinstance(a, Quantity | Semver) and type(a) is type(b)):
        raise TypeError(f"{name}: no overload for ({type(a).__name__}, {type(b).__name__})")


def _compare_to(a: Any, b: Any) -> celtypes.IntType:
    _same_kind(a, b, "compareTo")
    return celtypes.IntType((a > b) - (a < b))


def _greater(a: Any, b: Any) -> celtypes.BoolType:
    _same_kind(a, b, "isGreaterThan")
    return celtypes.BoolType(a > b)


def _less(a: Any, b: Any) -> celtypes.BoolType:
    _same_kind(a, b, "isLessThan")
    return celtypes.BoolType(a < b)


def _is(parse: Callable[[str], object]) -> Callable[[Any], celtypes.BoolType]:
    def check(text: Any) -> celtypes.BoolType:
        try:
            parse(str(text))
        except CelValueError:
            return celtypes.BoolType(False)
        return celtypes.BoolType(True)

    return check


def _quantity_add(a: Quantity, b: Any) -> Quantity:
    other = b if isinstance(b, Quantity) else Quantity(Fraction(int(b)), str(b))
    return Quantity(a.value + other.value, f"{a.text}+{other.text}")


def _quantity_sub(a: Quantity, b: Any) -> Quantity:
    other = b if isinstance(b, Quantity) else Quantity(Fraction(int(b)), str(b))
    return Quantity(a.value - other.value, f"{a.text}-{other.text}")


def _as_integer(q: Quantity) -> celtypes.IntType:
    if q.value.denominator != 1 or not -(2**63) <= q.value < 2**63:
        raise CelValueError(f"quantity {q.text!r} is not an int64")
    return celtypes.IntType(int(q.value))


#: the Kubernetes CEL library functions, as cel-python functions (member calls get the receiver first)
KUBERNETES_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda text: Quantity.parse(str(text)),
    "isQuantity": _is(Quantity.parse),
    "semver": lambda text: Semver.parse(str(text)),
    "isSemver": _is(Semver.parse),
    "compareTo": _compare_to,
    "isGreaterThan": _greater,
    "isLessThan": _less,
    "add": _quantity_add,
    "sub": _quantity_sub,
    "asInteger": _as_integer,
    "isInteger": lambda q: celtypes.BoolType(q.value.denominator == 1 and -(2**63) <= q.value < 2**63),
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(q.value)),
    "sign": lambda q: celtypes.IntType((q.value > 0) - (q.value < 0)),
    "major": lambda v: celtypes.IntType(v.major),
    "minor": lambda v: celtypes.IntType(v.minor),
    "patch": lambda v: celtypes.IntType(v.patch),
}

#: functions and macros of CEL itself that cel-python provides
STANDARD_FUNCTIONS = frozenset(
    {
        "size", "has", "all", "exists", "exists_one", "map", "filter", "matches", "startsWith",
        "endsWith", "contains", "int", "uint", "double", "string", "bytes", "bool", "type", "dyn",
        "duration", "timestamp",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class CelEnvironment:
    """Which variables an expression may use at its top level (cel-go rejects any other name)."""

    name: str
    variables: frozenset[str]


#: DeviceClass and ResourceClaim selectors (resource.k8s.io)
DRA_SELECTOR = CelEnvironment("DRA device selector", frozenset({"device"}))
#: ValidatingAdmissionPolicy matchConditions, variables and validations
ADMISSION_POLICY = CelEnvironment(
    "admission policy",
    frozenset({"request", "object", "oldObject", "params", "namespaceObject", "variables", "authorizer"}),
)


class CelCompileError(ValueError):
    """An expression Kubernetes would reject before evaluating it."""


class CelEvaluationError(RuntimeError):
    """An expression that failed at run time (the scheduler aborts the allocation attempt)."""


@dataclass(frozen=True, slots=True)
class CompiledExpression:
    source: str
    environment: CelEnvironment
    program: celpy.Runner

    def evaluate(self, activation: Mapping[str, Any]) -> Any:
        """The value for ``activation`` (cel-python values); a run-time error raises CelEvaluationError."""
        try:
            result = self.program.evaluate(dict(activation))
        except celpy.CELEvalError as exc:
            raise CelEvaluationError(f"{self.source[:80]!r}: {exc.args[0] if exc.args else exc}") from exc
        if isinstance(result, celpy.CELEvalError):
            raise CelEvaluationError(f"{self.source[:80]!r}: {result.args[0] if result.args else result}")
        return result


def _names_used(tree: lark.Tree) -> tuple[set[str], set[str]]:
    """(function names called, top-level variable names read) in a cel-python parse tree."""
    functions: set[str] = set()
    variables: set[str] = set()
    bound: set[str] = set()
    for node in tree.iter_subtrees():
        if node.data in ("member_dot_arg", "ident_arg", "dot_ident_arg"):
            token = next(c for c in node.children if isinstance(c, lark.Token))
            functions.add(str(token))
            if str(token) in ("all", "exists", "exists_one", "map", "filter"):
                # macro variables (l.all(x, ...)) are not top-level variables
                args = [c for c in node.children if isinstance(c, lark.Tree) and c.data == "exprlist"]
                if args:
                    first = args[0].children[0]
                    bound.update(str(t) for t in first.scan_values(lambda v: isinstance(v, lark.Token)))
        elif node.data == "ident":
            variables.add(str(node.children[0]))
    return functions, variables - bound


def compile_expression(source: str, environment: CelEnvironment = DRA_SELECTOR) -> CompiledExpression:
    """Parse ``source`` and check its names against ``environment``; CelCompileError on failure."""
    if len(source.encode()) > MAX_EXPRESSION_BYTES:
        raise CelCompileError(f"expression of {len(source.encode())} bytes, over {MAX_EXPRESSION_BYTES}")
    env = celpy.Environment()
    try:
        tree = env.compile(source)
    except celpy.CELParseError as exc:
        raise CelCompileError(f"{source[:80]!r} does not parse: {str(exc).splitlines()[0]}") from exc
    functions, variables = _names_used(tree)
    unknown_functions = functions - STANDARD_FUNCTIONS - set(KUBERNETES_FUNCTIONS)
    if unknown_functions:
        raise CelCompileError(f"{source[:80]!r}: undeclared functions {sorted(unknown_functions)}")
    unknown_variables = variables - environment.variables
    if unknown_variables:
        raise CelCompileError(
            f"{source[:80]!r}: undeclared variables {sorted(unknown_variables)} in {environment.name}"
        )
    return CompiledExpression(source, environment, env.program(tree, functions=KUBERNETES_FUNCTIONS))


# --- DRA devices ------------------------------------------------------------------------


class _DomainMap(celtypes.MapType):
    """``device.attributes`` / ``device.capacity``: an unknown domain is an empty map, not an error."""

    def __getitem__(self, key: Any) -> Any:
        if key not in self.keys():
            return celtypes.MapType()
        return super().__getitem__(key)


def _attribute_value(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        if len(value) != 1:
            raise ValueError(f"{where}: a DeviceAttribute has exactly one of int, bool, string, version")
        ((kind, raw),) = value.items()
        converters: dict[str, Callable[[Any], Any]] = {
            "int": celtypes.IntType,
            "bool": celtypes.BoolType,
            "string": celtypes.StringType,
            "version": Semver.parse,
        }
        if kind not in converters:
            raise ValueError(f"{where}: unknown attribute type {kind!r}")
        return converters[kind](raw)
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    raise ValueError(f"{where}: unsupported attribute value {value!r}")


def device_variable(device: Mapping[str, Any]) -> celtypes.MapType:
    """The CEL ``device`` variable for one device dict (see the module docstring)."""
    attributes = _DomainMap()
    for domain, values in device.get("attributes", {}).items():
        attributes[celtypes.StringType(domain)] = celtypes.MapType(
            {celtypes.StringType(k): _attribute_value(v, f"{domain}/{k}") for k, v in values.items()}
        )
    capacity = _DomainMap()
    for domain, values in device.get("capacity", {}).items():
        capacity[celtypes.StringType(domain)] = celtypes.MapType(
            {celtypes.StringType(k): Quantity.parse(str(v)) for k, v in values.items()}
        )
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(device["driver"]),
            celtypes.StringType("attributes"): attributes,
            celtypes.StringType("capacity"): capacity,
        }
    )


def matches(expression: CompiledExpression | str, device: Mapping[str, Any]) -> bool:
    """Whether one selector accepts ``device``; an error or a non-bool result raises CelEvaluationError."""
    compiled = expression if isinstance(expression, CompiledExpression) else compile_expression(expression)
    result = compiled.evaluate({"device": device_variable(device)})
    if not isinstance(result, celtypes.BoolType):
        raise CelEvaluationError(f"{compiled.source[:80]!r} gave {type(result).__name__}, not a bool")
    return bool(result)


def class_selectors(device_class: Mapping[str, Any]) -> list[CompiledExpression]:
    """Every CEL selector of a DeviceClass object, compiled."""
    return [compile_expression(s["cel"]["expression"]) for s in device_class["spec"].get("selectors", [])]


def select(device_class: Mapping[str, Any], devices: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The devices a DeviceClass admits: every one of its selectors must accept the device."""
    selectors = class_selectors(device_class)
    return [d for d in devices if all(matches(s, d) for s in selectors)]


def devices_from_resource_slice(resource_slice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The devices of a ResourceSlice (v1, or v1beta1 with ``basic``) as device dicts.

    Unqualified attribute and capacity names belong to the slice's driver; ``domain/name`` keys
    to that domain. Each dict also carries the device ``name`` (selectors never see it).
    """
    driver = resource_slice["spec"]["driver"]
    devices = []
    for entry in resource_slice["spec"].get("devices", []):
        body = entry.get("basic", entry)
        attributes: dict[str, dict[str, Any]] = {}
        for key, value in (body.get("attributes") or {}).items():
            domain, _, name = key.rpartition("/")
            attributes.setdefault(domain or driver, {})[name] = value
        capacity: dict[str, dict[str, Any]] = {}
        for key, value in (body.get("capacity") or {}).items():
            domain, _, name = key.rpartition("/")
            capacity.setdefault(domain or driver, {})[name] = value["value"] if isinstance(value, Mapping) else value
        devices.append({"name": entry["name"], "driver": driver, "attributes": attributes, "capacity": capacity})
    return devices


def to_cel(value: Any) -> Any:
    """A JSON-like Python value (an admission request, an object) as cel-python values."""
    return celpy.json_to_cel(value)


__all__ = [
    "ADMISSION_POLICY",
    "DRA_SELECTOR",
    "CelCompileError",
    "CelEvaluationError",
    "Quantity",
    "Semver",
    "class_selectors",
    "compile_expression",
    "device_variable",
    "devices_from_resource_slice",
    "matches",
    "select",
    "to_cel",
]
