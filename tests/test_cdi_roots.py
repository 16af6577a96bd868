"""The driver root as the agent sees it vs. as the host's container runtime sees it.

The fake driver lives at one temporary path (the pod's ``/driver-root``); specs must name
another one (the host's ``/run/nvidia/driver``) that does not exist here, so anything that
stats or reads through the host path instead of the visible one fails.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import agent.base.logs
import agent.cli.main
import agent.cli.run
from agent.base.errors import ConfigError
from agent.cdi import generate
from agent.cdi import spec as s
from agent.cdi.discovery import DriverDiscovery
from agent.cdi.roots import RootMapping
from agent.cdi.service import CdiService, create_cdi_service
from agent.core.config.loader import build_config, env_overrides
from agent.core.config.schema import CdiConfig
from agent.core.inventory.current import InventoryState
from tests.cdi_fixtures import LIB_DIR, VERSION, FakeDriver, fake_hook, inventory, mig, node_numbers, prepare_claim

KIND = "k8s.gpu-node-agent.nvidia.com/gpu"
DP_FILE = "k8s.gpu-node-agent.nvidia.com-gpu.json"
HOOK_ON_HOST = Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook")


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    return FakeDriver(tmp_path / "pod" / "driver-root", cap_minors=(21, 22)).build()


@pytest.fixture
def host_root(tmp_path: Path) -> Path:
    root = tmp_path / "host-view" / "run" / "nvidia" / "driver"  # never created: only the runtime sees it
    assert not root.exists()
    return root


def device_plugin_spec(discovery: DriverDiscovery, n_gpus: int = 2) -> s.Spec:
    inv = inventory(n_gpus, migs={1: (mig(1, 0, 21, 22),)})
    files = discovery.discover(generate.gpu_minors(inv), generate.cap_minors(inv))
    result = generate.device_plugin_spec(KIND, inv, files)
    assert result.spec is not None
    return result.spec


def all_edits(spec: s.Spec) -> list[s.ContainerEdits]:
    return [spec.container_edits, *(d.container_edits for d in spec.devices)]


def host_paths(spec: s.Spec) -> list[str]:
    """Every path the runtime resolves on the host: node and mount hostPaths."""
    out: list[str] = []
    for edits in all_edits(spec):
        out += [n.host_path or n.path for n in edits.device_nodes]
        out += [m.host_path for m in edits.mounts]
    return out


def moved(spec: s.Spec, old: Path, new: Path) -> s.Spec:
    """The test's own oracle: ``spec`` with the host paths under ``old`` put under ``new``."""

    def move(path: str) -> str:
        return str(new) + path[len(str(old)) :] if path.startswith(f"{old}/") else path

    def edits(e: s.ContainerEdits) -> s.ContainerEdits:
        nodes = tuple(
            dataclasses.replace(n, host_path=move(n.host_path) if n.host_path else None) for n in e.device_nodes
        )
        mounts = tuple(dataclasses.replace(m, host_path=move(m.host_path)) for m in e.mounts)
        return dataclasses.replace(e, device_nodes=nodes, mounts=mounts)

    devices = tuple(dataclasses.replace(d, container_edits=edits(d.container_edits)) for d in spec.devices)
    return dataclasses.replace(spec, devices=devices, container_edits=edits(spec.container_edits))


# --- the mapping -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("container", "host", "path", "expected"),
    [
        ("/driver-root", "/run/nvidia/driver", "/driver-root/usr/lib/libc.so", "/run/nvidia/driver/usr/lib/libc.so"),
        ("/driver-root", "/run/nvidia/driver", "/driver-root", "/run/nvidia/driver"),
        ("/driver-root", "/run/nvidia/driver", "/dev/nvidia0", "/dev/nvidia0"),  # outside: the host's own /dev
        ("/driver-root", "/run/nvidia/driver", "/driver-root-old/lib.so", "/driver-root-old/lib.so"),  # a sibling
        ("/host", "/", "/host/dev/nvidiactl", "/dev/nvidiactl"),  # the host's / mounted at /host
        ("/", "/host", "/usr/lib/libcuda.so", "/host/usr/lib/libcuda.so"),
        ("/driver-root", "/driver-root", "/driver-root//odd/../path", "/driver-root//odd/../path"),  # identity: as is
    ],
)
def test_host_path(container: str, host: str, path: str, expected: str) -> None:
    assert RootMapping(Path(container), Path(host)).host_path(path) == expected


# --- generated specs -----------------------------------------------------------------------


def test_every_host_path_is_under_the_host_root(tmp_path: Path, driver: FakeDriver, host_root: Path) -> None:
    hook = fake_hook(tmp_path / "bin")
    same = device_plugin_spec(DriverDiscovery(driver.root, hook_candidates=[hook], machine="x86_64"))
    mapped = device_plugin_spec(
        DriverDiscovery(driver.root, host_driver_root=host_root, hook_candidates=[hook], machine="x86_64")
    )
    paths = host_paths(mapped)
    assert paths and all(p.startswith(f"{host_root}/") for p in paths), paths
    assert not any(str(driver.root) in p for p in paths)
    assert mapped == moved(same, driver.root, host_root)  # container paths, names, numbers, options unchanged
    assert s.validate(mapped) == [] and mapped.version == s.minimum_version(mapped)
    mounts = {m.container_path: m.host_path for m in mapped.container_edits.mounts}
    assert mounts[f"{LIB_DIR}/libcuda.so.{VERSION}"] == f"{host_root}{LIB_DIR}/libcuda.so.{VERSION}"
    # the hook binary was found outside the driver root and the hook args are container paths
    assert [h.path for h in mapped.container_edits.hooks] == [str(hook), str(hook)]
    assert mapped.container_edits.hooks == same.container_edits.hooks


def test_nodes_are_stated_through_the_visible_root(driver: FakeDriver, host_root: Path) -> None:
    driver.add_node("/dev/nvidia1", (1, 5))
    driver.host("/dev/nvidia-caps/nvidia-cap22").unlink()  # the MIG device's CI node is gone
    discovery = DriverDiscovery(driver.root, host_driver_root=host_root, hook_candidates=[])
    inv = inventory(2, migs={1: (mig(1, 0, 21, 22),)})
    files = discovery.discover(generate.gpu_minors(inv), generate.cap_minors(inv))
    node = files.gpu_nodes[1]
    assert node.host_path == f"{host_root}/dev/nvidia1"
    assert (node.major, node.minor) == node_numbers(driver.host("/dev/nvidia1"))
    result = generate.device_plugin_spec(KIND, inv, files)
    assert result.skipped and result.skipped[0].startswith(inv.gpus[1].mig_devices[0].uuid)


def test_host_root_slash_drops_host_paths_equal_to_container_paths(tmp_path: Path) -> None:
    """The host's ``/`` mounted at ``/host``: nodes need no hostPath, mounts name host paths."""
    host = FakeDriver(tmp_path / "host").build()
    spec = device_plugin_spec(DriverDiscovery(host.root, host_driver_root=Path("/"), hook_candidates=[]))
    nodes = [n for e in all_edits(spec) for n in e.device_nodes]
    assert nodes and all(n.host_path is None for n in nodes)
    mounts = {m.container_path: m.host_path for m in spec.container_edits.mounts}
    assert mounts[f"{LIB_DIR}/libcuda.so.{VERSION}"] == f"{LIB_DIR}/libcuda.so.{VERSION}"
    assert mounts[f"{LIB_DIR}/libcuda.so.1"] == f"{LIB_DIR}/libcuda.so.{VERSION}"  # no hook: links as files
    assert not any(p.startswith(str(tmp_path)) for p in mounts.values())
    assert s.validate(spec) == [] and spec.version == s.minimum_version(spec)


def test_the_same_root_changes_nothing(tmp_path: Path, driver: FakeDriver) -> None:
    hook = fake_hook(tmp_path / "bin")
    default = device_plugin_spec(DriverDiscovery(driver.root, hook_candidates=[hook]))
    explicit = device_plugin_spec(DriverDiscovery(driver.root, host_driver_root=driver.root, hook_candidates=[hook]))
    assert s.dumps(explicit) == s.dumps(default)


@pytest.mark.parametrize(
    ("hook_path", "prefix"),
    [(HOOK_ON_HOST, ("nvidia-cdi-hook",)), (Path("/usr/bin/nvidia-ctk"), ("nvidia-ctk", "hook"))],
)
def test_hook_path_is_written_as_given(
    tmp_path: Path, driver: FakeDriver, host_root: Path, hook_path: Path, prefix: tuple[str, ...]
) -> None:
    found = fake_hook(tmp_path / "bin")  # a candidate the agent can see: the configured path wins
    discovery = DriverDiscovery(driver.root, host_driver_root=host_root, hook_path=hook_path, hook_candidates=[found])
    spec = device_plugin_spec(discovery)
    hooks = spec.container_edits.hooks
    assert {h.path for h in hooks} == {str(hook_path)}
    assert all(h.args[: len(prefix)] == prefix for h in hooks)
    assert ("update-ldcache", "--folder", LIB_DIR) in [h.args[len(prefix) :] for h in hooks]
    # with a hook the SONAME links are its job, not mounts'
    assert f"{LIB_DIR}/libcuda.so.1" not in {m.container_path for m in spec.container_edits.mounts}


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"paths": {"host_driver_root": "run/nvidia/driver"}}, "paths.host_driver_root"),
        ({"cdi": {"hook_path": "nvidia-cdi-hook"}}, "cdi.hook_path"),
    ],
)
def test_relative_paths_are_rejected_naming_the_field(document: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: must be an absolute path"):
        build_config(document)


def test_defaults_and_environment() -> None:
    config = build_config({})
    assert config.paths.host_driver_root is None and config.cdi.hook_path is None
    env = {"GPU_AGENT_HOST_DRIVER_ROOT": "/run/nvidia/driver", "GPU_AGENT_CDI_HOOK_PATH": str(HOOK_ON_HOST)}
    config = build_config({}, env_overrides(env))
    assert config.paths.host_driver_root == Path("/run/nvidia/driver")
    assert config.cdi.hook_path == HOOK_ON_HOST


def test_run_flag_becomes_an_override(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    async def fake_run(options: Any) -> int:
        seen.append(options)
        return 0

    monkeypatch.setattr(agent.cli.run, "_run", fake_run)
    monkeypatch.setattr(agent.base.logs, "configure_logging", lambda level: None)
    result = CliRunner().invoke(agent.cli.main.app, ["run", "--simulated", "--host-driver-root", "/run/nvidia/driver"])
    assert result.exit_code == 0, result.output
    assert seen[0].overrides["paths.host_driver_root"] == "/run/nvidia/driver"
    # the agent's own reading of the arguments (no typer) gives the same override
    values = agent.cli.run.parse_run_args(["--simulated", "--host-driver-root", "/run/nvidia/driver"], {})
    assert values is not None and agent.cli.run.run_command(values) == 0
    assert seen[1].overrides["paths.host_driver_root"] == "/run/nvidia/driver"


# --- the service and the composition root ---------------------------------------------------


async def test_service_writes_host_paths_and_reconciles_without_drift(
    tmp_path: Path, driver: FakeDriver, host_root: Path
) -> None:
    registry = CollectorRegistry()
    service = CdiService(
        config=CdiConfig(hook_path=HOOK_ON_HOST),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        host_driver_root=host_root,
        inventory=InventoryState(inventory(2)),
        registry=registry,
        hook_candidates=[],
    )
    await service.ensure_device_plugin_spec()
    names = await prepare_claim(service, "0e3f1a2b-aaaa-bbbb-cccc-000000000001", [inventory(2).gpus[0].uuid])
    assert names
    for path in sorted((tmp_path / "cdi").iterdir()):
        spec = s.loads(path.read_text())
        assert all(p.startswith(f"{host_root}/") for p in host_paths(spec)), path.name
        assert {h.path for h in spec.container_edits.hooks} == {str(HOOK_ON_HOST)}
    report = await service.reconcile_once()
    assert report.repairs == () and report.errors == ()  # generated == on disk: no false drift
    driver.add_node("/dev/nvidia0", (1, 7))  # new device numbers under the visible root
    report = await service.reconcile_once()
    assert {(r.action, r.file) for r in report.repairs} >= {("rewritten", DP_FILE)}
    spec = s.loads((tmp_path / "cdi" / DP_FILE).read_text())
    node = next(n for d in spec.devices if d.name == "0" for n in d.container_edits.device_nodes)
    assert node.host_path == f"{host_root}/dev/nvidia0"
    assert (node.major, node.minor) == node_numbers(driver.host("/dev/nvidia0"))
    state = service.debug_state()
    assert state["driver_root"] == str(driver.root) and state["host_driver_root"] == str(host_root)


async def test_the_node_config_passes_the_host_root(tmp_path: Path, driver: FakeDriver, host_root: Path) -> None:
    config = build_config(
        {
            "paths": {"cdi_root": str(tmp_path / "cdi"), "driver_root": str(driver.root)},
            "cdi": {"hook_path": str(HOOK_ON_HOST)},
        },
        {"paths.host_driver_root": str(host_root)},
    )
    cdi = create_cdi_service(config, inventory=InventoryState(inventory(2)), registry=CollectorRegistry())
    assert isinstance(cdi, CdiService)
    await cdi.ensure_device_plugin_spec()
    spec = s.loads((tmp_path / "cdi" / DP_FILE).read_text())
    assert all(p.startswith(f"{host_root}/") for p in host_paths(spec))
    assert {h.path for h in spec.container_edits.hooks} == {str(HOOK_ON_HOST)}
    assert cdi.debug_state()["host_driver_root"] == str(host_root)
