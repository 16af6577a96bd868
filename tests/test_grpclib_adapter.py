"""grpclib's and h2's internals are touched in one module, for the versions it names, and nowhere else.

:mod:`agent.grpc.grpclib_adapter` states the grpclib and h2 releases it was written for and what
in them it relies on (``RECHECK``). Here: the installed releases are those (else the failure
says what to re-read), the pins say so too, no other module in ``agent/`` touches an internal
(a check of the source's syntax tree, shown catching each kind of touch), and the surface does
what the rest of the agent relies on, over a real socket.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpclib.const
import h2.events
import pytest

from agent._proto.deviceplugin import v1beta1 as pb
from agent.grpc.grpclib_adapter import GRPCLIB_VERSION, H2_VERSION, RECHECK, connection_of
from agent.grpc.limits import GrpcLimits
from agent.grpc.sockets import UnixGrpcServer
from tests.rawgrpc import RawGrpc, frame
from tests.test_grpc_limits import served
from tests.test_plugin_fakes import short_tmpdir

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "agent" / "grpc" / "grpclib_adapter.py"

# --- the versions ---------------------------------------------------------------------------


def version_mismatch(installed: dict[str, str]) -> str | None:
    """What to tell whoever installed other releases than the adapter's; None when they match."""
    written_for = {"grpclib": GRPCLIB_VERSION, "h2": H2_VERSION}
    if installed == written_for:
        return None
    found = ", ".join(f"{name} {installed[name]}" for name in written_for)
    wanted = ", ".join(f"{name} {v}" for name, v in written_for.items())
    steps = "\n".join(f"  - {item}" for item in RECHECK)
    return (
        f"installed {found}; agent/grpc/grpclib_adapter.py was written for {wanted}.\n"
        f"It uses these internals; re-read each in the new release before moving the pins:\n{steps}\n"
        "Then update GRPCLIB_VERSION and H2_VERSION there, the pins in pyproject.toml and "
        "container/constraints.txt, and run tests/test_grpc_bursts.py, tests/test_grpc_limits.py and this file."
    )


def test_grpclib_and_h2_are_the_versions_the_adapter_was_written_for() -> None:
    message = version_mismatch({"grpclib": version("grpclib"), "h2": version("h2")})
    if message is not None:
        pytest.fail(message, pytrace=False)


def test_a_different_release_fails_naming_what_to_recheck() -> None:
    message = version_mismatch({"grpclib": "0.4.10", "h2": H2_VERSION})
    assert message is not None
    assert f"installed grpclib 0.4.10, h2 {H2_VERSION}" in message
    assert f"written for grpclib {GRPCLIB_VERSION}, h2 {H2_VERSION}" in message
    assert "Server._protocol_factory" in message and "H2Protocol.connection_made" in message


def _pins(lines: list[str]) -> dict[str, str]:
    pins = {}
    for line in lines:
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = pinned.split(";", 1)[0].strip()
    return pins


def test_pyproject_and_the_image_constraints_pin_those_versions() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    constraints = (ROOT / "container" / "constraints.txt").read_text().splitlines()
    wanted = {"grpclib": GRPCLIB_VERSION, "h2": H2_VERSION}
    for pins in (_pins(dependencies), _pins(constraints)):
        assert {name: pins.get(name) for name in wanted} == wanted


# --- who touches internals --------------------------------------------------------------------

#: grpclib's public modules: its documentation's reference (server, client, config, events,
#: exceptions, metadata, health, reflection, testing, utils, the codec interface) and const
#: (Status, Handler, Cardinality, used by every generated stub)
PUBLIC_GRPCLIB = (
    "grpclib",
    "grpclib.client",
    "grpclib.config",
    "grpclib.const",
    "grpclib.encoding.base",
    "grpclib.encoding.proto",
    "grpclib.events",
    "grpclib.exceptions",
    "grpclib.health",
    "grpclib.metadata",
    "grpclib.reflection",
    "grpclib.server",
    "grpclib.testing",
    "grpclib.utils",
)
LIBRARIES = ("grpclib", "h2")


def _is_public(module: str) -> bool:
    return module in PUBLIC_GRPCLIB or module.startswith(("grpclib.health.", "grpclib.reflection."))


def _modules(library: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of an installed library."""
    spec = importlib.util.find_spec(library)
    assert spec is not None and spec.origin is not None
    root = Path(spec.origin).parent
    for path in sorted(root.rglob("*.py")):
        parts = [library, *path.relative_to(root).with_suffix("").parts]
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def library_private_names() -> frozenset[str]:
    """Every ``_name`` grpclib and h2 define or set on their objects (methods, attributes)."""
    names: set[str] = set()
    for library in LIBRARIES:
        for _module, path in _modules(library):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            names.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            names.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return frozenset(filter(_private, names))


PRIVATE_NAMES = library_private_names()
GRPCLIB_MODULES = frozenset(name for name, _path in _modules("grpclib"))


class _Touches(ast.NodeVisitor):
    """The places one module touches grpclib's or h2's internals, one line each."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._library_names: set[str] = set(LIBRARIES)  # names bound to grpclib/h2 modules or objects

    def _add(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{getattr(node, 'lineno', 0)}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in LIBRARIES:
                self._library_names.add(alias.asname or alias.name.split(".")[0])
                if not _is_public(alias.name):
                    self._add(node, f"imports {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] not in LIBRARIES:
            return
        if not _is_public(module):
            self._add(node, f"imports from {module}")
            return
        for alias in node.names:
            self._library_names.add(alias.asname or alias.name)
            submodule = f"{module}.{alias.name}"
            if _private(alias.name) or (submodule in GRPCLIB_MODULES and not _is_public(submodule)):
                self._add(node, f"imports {alias.name} from {module}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        receiver = node.value
        if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
            self._add(node, f"swaps the class of {ast.unparse(receiver)}")
        elif node.attr in PRIVATE_NAMES and not (isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")):
            self._add(node, f"reads or sets {ast.unparse(node)}, a private name of grpclib or h2")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Name) and function.id in ("getattr", "setattr", "hasattr", "delattr"):
            for argument in node.args[1:2]:
                if isinstance(argument, ast.Constant) and argument.value in PRIVATE_NAMES:
                    self._add(node, f"{function.id}(..., {argument.value!r}), a private name of grpclib or h2")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            root = base
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if isinstance(root, ast.Name) and root.id in self._library_names:
                self._add(node, f"class {node.name} subclasses {ast.unparse(base)}")
        self.generic_visit(node)


def touches(source: str) -> list[str]:
    visitor = _Touches()
    visitor.visit(ast.parse(source))
    return visitor.found


def agent_modules() -> Iterator[Path]:
    yield from sorted((ROOT / "agent").rglob("*.py"))


def test_no_module_but_the_adapter_touches_grpclib_or_h2_internals() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in agent_modules()
        if path != ADAPTER
        for line in touches(path.read_text())
    ]
    assert found == [], "only agent/grpc/grpclib_adapter.py may touch grpclib's or h2's internals"


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("import h2.settings", "imports h2.settings"),
        ("from h2.connection import H2Connection", "imports from h2.connection"),
        ("from grpclib.protocol import H2Protocol", "imports from grpclib.protocol"),
        ("import grpclib.stream", "imports grpclib.stream"),
        ("from grpclib import protocol", "imports protocol from grpclib"),
        ("from grpclib.utils import _cached", "imports _cached from grpclib.utils"),
        ("raw = stream._stream", "stream._stream"),
        ("connection._connection.close_connection()", "connection._connection"),
        ("server._protocol_factory = make", "server._protocol_factory"),
        ("key = getattr(stream.peer, '_transport', None)", "getattr(..., '_transport')"),
        ("protocol.__class__ = Coalescing", "swaps the class of protocol"),
        ("from grpclib.server import Server\nclass S(Server):\n    pass", "class S subclasses Server"),
        ("import grpclib.server\nclass S(grpclib.server.Server):\n    pass", "subclasses grpclib.server.Server"),
    ],
)
def test_the_check_catches_each_kind_of_touch(source: str, what: str) -> None:
    found = touches(source)
    assert any(what in line for line in found), found


def test_the_check_lets_the_public_api_and_our_own_private_attributes_pass() -> None:
    source = """
import grpclib.const
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.server import Stream
from grpclib.client import Channel
from grpclib.metadata import Deadline
from grpclib.exceptions import StreamTerminatedError
from agent.grpc.grpclib_adapter import recv_data

class Servicer:
    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._transport = None

    async def handle(self) -> None:
        await recv_data(self._stream, 5)
        raise GRPCError(Status.INVALID_ARGUMENT, "no")
"""
    assert touches(source) == []


def test_the_adapter_touches_internals_and_names_each_in_recheck() -> None:
    """Run on the adapter itself, the check finds what it is there for; RECHECK lists every name."""
    found = touches(ADAPTER.read_text())
    private = {name for name in PRIVATE_NAMES if any(f".{name}" in line or f"'{name}'" in line for line in found)}
    assert {"_protocol_factory", "_connection", "_stream", "_transport"} <= private, found
    assert any("imports from grpclib.protocol" in line for line in found)
    assert any("imports from h2.settings" in line for line in found)
    recheck = "\n".join(RECHECK)
    assert [name for name in private if name not in recheck] == []
    assert not any("swaps the class" in line for line in found), "the adapter builds protocols, it swaps none"


# --- the surface, on a real socket ------------------------------------------------------------


@pytest.mark.integration
async def test_an_idle_connection_that_made_a_call_gets_a_goaway_then_eof() -> None:
    """open_streams and last_stream_started keep it open while busy; goaway_and_close ends it."""
    async with served(GrpcLimits(idle_timeout_s=0.3)) as s:
        raw = await RawGrpc.connect(s.path)
        try:
            assert (await raw.call("GetDevicePluginOptions", frame(b""))).status == 0
            events = await raw.events_until_closed(within_s=10)
        finally:
            await raw.close()
    goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(goaways) == 1 and goaways[0].error_code == 0  # NO_ERROR


class _Recording:
    """A servicer whose one method records the connection each call came on."""

    def __init__(self) -> None:
        self.connections: list[object] = []

    async def options(self, stream: Any) -> None:
        self.connections.append(connection_of(stream))
        await stream.recv_message()
        await stream.send_message(pb.DevicePluginOptions())

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/v1beta1.DevicePlugin/GetDevicePluginOptions": grpclib.const.Handler(
                self.options, grpclib.const.Cardinality.UNARY_UNARY, pb.Empty, pb.DevicePluginOptions
            )
        }


@pytest.mark.integration
async def test_connection_of_is_one_key_per_connection() -> None:
    servicer = _Recording()
    with short_tmpdir() as root:
        async with UnixGrpcServer(root / "s.sock", [servicer]):
            clients = [await RawGrpc.connect(root / "s.sock") for _ in range(2)]
            try:
                for client in clients * 2:  # two calls on each, in turn
                    answer = await client.call("GetDevicePluginOptions", frame(b""))
                    assert answer.status == 0
            finally:
                for client in clients:
                    await client.close()
    first, second, first_again, second_again = servicer.connections
    assert first == first_again and second == second_again and first != second
