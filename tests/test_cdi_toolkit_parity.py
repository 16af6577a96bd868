"""Specs that carry what ``nvidia-ctk cdi generate`` writes: DRM nodes and their by-path links,
the toolkit's hooks in its order and environment, the MPS pipe directory, the hook binary found
where the host has it, live device nodes, and the driver version NVML reports."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.cdi import generate
from agent.cdi import spec as s
from agent.cdi.discovery import DriverDiscovery, DriverFiles
from agent.cdi.errors import DriverDiscoveryError
from agent.cdi.hooks import HOOK_ENV
from agent.cdi.service import CdiService
from agent.core.config.schema import CdiConfig
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from tests.cdi_fixtures import (
    CURRENT_SUBCOMMANDS,
    LIB_DIR,
    NEW_VERSION,
    VERSION,
    FakeDriver,
    fake_hook,
    inventory,
    node_numbers,
)

KIND = "k8s.gpu-node-agent.nvidia.com/gpu"


def look(discovery: DriverDiscovery, inv: Inventory) -> DriverFiles:
    return discovery.discover(
        generate.gpu_minors(inv),
        generate.cap_minors(inv),
        buses=[g.short_bus_id for g in inv],
        driver_version=inv.driver_version,
    )


def plugin_spec(discovery: DriverDiscovery, inv: Inventory) -> s.Spec:
    result = generate.device_plugin_spec(KIND, inv, look(discovery, inv))
    assert result.spec is not None and s.validate(result.spec) == []
    assert result.spec.version == s.minimum_version(result.spec)
    return result.spec


def device(spec: s.Spec, name: str) -> s.ContainerEdits:
    return next(d.container_edits for d in spec.devices if d.name == name)


# --- hooks ------------------------------------------------------------------------------------


def test_hooks_in_the_toolkits_order_with_its_environment(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    hook = fake_hook(tmp_path / "bin", subcommands=CURRENT_SUBCOMMANDS)
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[hook], machine="x86_64"), inventory(2))
    hooks = spec.container_edits.hooks
    assert [h.args for h in hooks] == [
        ("nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{LIB_DIR}/libcuda.so"),
        ("nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={VERSION}"),
        ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB_DIR),
        ("nvidia-cdi-hook", "disable-device-node-modification"),
    ]
    assert all(h.hook_name == "createContainer" and h.path == str(hook) and h.env == HOOK_ENV for h in hooks)
    assert spec.container_edits.env == (f"NVIDIA_CTK_LIBCUDA_DIR={LIB_DIR}", "NVIDIA_VISIBLE_DEVICES=void")


def test_an_older_hook_binary_gets_only_the_subcommands_it_has(tmp_path: Path) -> None:
    """An unknown subcommand makes the hook fail, and with it the container's start."""
    driver = FakeDriver(tmp_path / "root").build()
    hook = fake_hook(tmp_path / "bin", subcommands=("enable-cuda-compat",))  # 1.17.5 .. 1.17.7
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[hook]), inventory(1))
    assert [h.args[1] for h in spec.container_edits.hooks] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
    ]
    older = fake_hook(tmp_path / "old", subcommands=())
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[older]), inventory(1))
    assert [h.args[1] for h in spec.container_edits.hooks] == ["create-symlinks", "update-ldcache"]


def test_a_configured_hook_the_agent_cannot_see_gets_the_older_hooks(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    configured = Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    with capture_logs() as logs:
        discovery = DriverDiscovery(
            driver.root, host_driver_root=Path("/run/nvidia/driver"), hook_path=configured, hook_candidates=[]
        )
        spec = plugin_spec(discovery, inventory(1))
        plugin_spec(discovery, inventory(1))
    assert {h.path for h in spec.container_edits.hooks} == {str(configured)}
    assert [h.args[1] for h in spec.container_edits.hooks] == ["create-symlinks", "update-ldcache"]
    assert [e["event"] for e in logs].count("cdi.hook_not_inspected") == 1


def test_the_hook_under_the_driver_root_is_named_by_its_host_path(tmp_path: Path) -> None:
    """The host's / mounted in the pod as the driver root: its nvidia-cdi-hook is the one to use."""
    host = FakeDriver(tmp_path / "host").build()
    fake_hook(host.host("/usr/bin"), subcommands=CURRENT_SUBCOMMANDS)
    candidates = [Path("/usr/bin/nvidia-cdi-hook")]
    spec = plugin_spec(DriverDiscovery(host.root, host_driver_root=Path("/"), hook_candidates=candidates), inventory(1))
    hooks = spec.container_edits.hooks
    assert {h.path for h in hooks} == {"/usr/bin/nvidia-cdi-hook"} and len(hooks) == 4
    mounts = {m.container_path for m in spec.container_edits.mounts}
    assert f"{LIB_DIR}/libcuda.so.1" not in mounts  # the hook makes the links


def test_the_hook_under_the_visible_host_root(tmp_path: Path) -> None:
    """A driver container's root under the host's / mounted at /host: the toolkit is on the host."""
    host_view = tmp_path / "host"
    driver = FakeDriver(host_view / "run" / "nvidia" / "driver").build()
    fake_hook(host_view / "usr/local/nvidia/toolkit", subcommands=CURRENT_SUBCOMMANDS)
    discovery = DriverDiscovery(
        driver.root,
        host_driver_root=Path("/run/nvidia/driver"),
        hook_candidates=[Path("/usr/bin/nvidia-cdi-hook"), Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook")],
    )
    spec = plugin_spec(discovery, inventory(1))
    assert {h.path for h in spec.container_edits.hooks} == {"/usr/local/nvidia/toolkit/nvidia-cdi-hook"}
    lib = next(m for m in spec.container_edits.mounts if m.container_path == f"{LIB_DIR}/libcuda.so.{VERSION}")
    assert lib.host_path == f"/run/nvidia/driver{LIB_DIR}/libcuda.so.{VERSION}"


# --- device nodes -----------------------------------------------------------------------------


def test_drm_nodes_and_by_path_links_per_gpu(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    sysfs = tmp_path / "sys"
    inv = inventory(2)
    for gpu, card in zip(inv.gpus, (1, 2), strict=True):
        driver.add_drm(sysfs, gpu, card)
    hook = fake_hook(tmp_path / "bin")
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[hook], sysfs_root=sysfs), inv)
    gpu0 = device(spec, "0")
    assert [n.path for n in gpu0.device_nodes] == ["/dev/nvidia0", "/dev/dri/card1", "/dev/dri/renderD129"]
    card = gpu0.device_nodes[1]
    assert (card.major, card.minor) == node_numbers(driver.host("/dev/dri/card1"))
    assert [h.args for h in gpu0.hooks] == [
        (
            "nvidia-cdi-hook",
            "create-symlinks",
            "--link",
            "../card1::/dev/dri/by-path/pci-0000:18:00.0-card",
            "--link",
            "../renderD129::/dev/dri/by-path/pci-0000:18:00.0-render",
        )
    ]
    assert device(spec, inv.gpus[0].uuid) == gpu0
    everything = device(spec, "all")
    assert {n.path for n in everything.device_nodes} >= {"/dev/dri/card1", "/dev/dri/card2", "/dev/dri/renderD130"}
    assert len(everything.hooks) == 2  # each GPU's links


def test_drm_nodes_without_a_hook_and_without_sysfs(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    sysfs = tmp_path / "sys"
    driver.add_drm(sysfs, inventory(1).gpus[0], 1)
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[], sysfs_root=sysfs), inventory(1))
    assert [n.path for n in device(spec, "0").device_nodes][1:] == ["/dev/dri/card1", "/dev/dri/renderD129"]
    assert device(spec, "0").hooks == ()  # no binary to make the links with
    bare = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[], sysfs_root=tmp_path / "nothing"), inventory(1))
    assert [n.path for n in device(bare, "0").device_nodes] == ["/dev/nvidia0"]


def test_device_nodes_come_from_the_hosts_live_dev(tmp_path: Path) -> None:
    """A driver container root without /dev/nvidiactl: nodes are the host's, read where the
    agent sees the host's / (live), not a copy of /dev made when the pod started."""
    host_view = tmp_path / "host"
    driver = FakeDriver(host_view / "run" / "nvidia" / "driver", with_extras=False).build()
    host_dev = FakeDriver(host_view, with_extras=False)  # only its nodes are used
    for path in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"):
        host_dev.add_node(path, (1, 5))
        driver.host(path).unlink()
    discovery = DriverDiscovery(driver.root, host_driver_root=Path("/run/nvidia/driver"), hook_candidates=[])
    inv = inventory(2)
    files = look(discovery, inv)
    assert files.dev_root == host_view
    ctl = files.control_nodes[0]
    assert ctl.path == "/dev/nvidiactl" and ctl.host_path is None  # the host's own /dev
    assert (ctl.major, ctl.minor) == node_numbers(host_view / "dev/nvidiactl")
    assert [n.path for n in files.control_nodes] == ["/dev/nvidiactl"]
    host_dev.add_node("/dev/nvidia-uvm", (1, 5))  # created by the driver after the agent started
    assert "/dev/nvidia-uvm" in [n.path for n in look(discovery, inv).control_nodes]


def test_falling_back_to_the_agents_own_dev_is_said_once(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root", with_extras=False).build()
    driver.host("/dev/nvidiactl").unlink()
    discovery = DriverDiscovery(driver.root, host_driver_root=Path("/run/nvidia/driver"), hook_candidates=[])
    with capture_logs() as logs:
        for _ in range(2):
            if Path("/dev/nvidiactl").exists():
                look(discovery, inventory(1))
            else:
                with pytest.raises(DriverDiscoveryError, match="required device node /dev/nvidiactl is missing"):
                    look(discovery, inventory(1))
    assert [e["event"] for e in logs].count("cdi.device_nodes_from_own_dev") == 1


# --- files --------------------------------------------------------------------------------------


def test_the_mps_pipe_directory_is_mounted(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    driver.host("/tmp/nvidia-mps").mkdir(parents=True)
    spec = plugin_spec(DriverDiscovery(driver.root, hook_candidates=[]), inventory(1))
    mps = next(m for m in spec.container_edits.mounts if m.container_path == "/tmp/nvidia-mps")
    assert mps.host_path == str(driver.host("/tmp/nvidia-mps"))
    assert mps.options == ("ro", "nosuid", "nodev", "rbind", "rprivate", "noexec")
    without = FakeDriver(tmp_path / "other").build()
    files = look(DriverDiscovery(without.root, hook_candidates=[]), inventory(1))
    assert str(without.host("/tmp/nvidia-mps")) in files.missing


def test_the_version_nvml_reports_picks_among_several(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    for lib in ("libnvidia-ml", "libcuda"):
        driver.host(f"{LIB_DIR}/{lib}.so.{NEW_VERSION}").write_text("stale")
    discovery = DriverDiscovery(driver.root, hook_candidates=[])
    with capture_logs() as logs:
        files = look(discovery, inventory(1, version=VERSION))
    assert files.version == VERSION
    paths = {m.container_path for m in files.mounts}
    assert f"{LIB_DIR}/libcuda.so.{VERSION}" in paths and f"{LIB_DIR}/libcuda.so.{NEW_VERSION}" not in paths
    assert any(e["event"] == "cdi.several_driver_versions" for e in logs)
    assert look(discovery, inventory(1, version=NEW_VERSION)).version == NEW_VERSION
    with pytest.raises(DriverDiscoveryError, match=r"more than one.*NVML reports 1\.2\.3"):
        look(discovery, inventory(1, version="1.2.3"))


def test_one_installed_version_wins_over_a_different_nvml_version(tmp_path: Path) -> None:
    """During a driver upgrade NVML may still report the old version; the files are the new ones."""
    driver = FakeDriver(tmp_path / "root", version=NEW_VERSION).build()
    discovery = DriverDiscovery(driver.root, hook_candidates=[])
    with capture_logs() as logs:
        assert look(discovery, inventory(1, version=VERSION)).version == NEW_VERSION
        look(discovery, inventory(1, version=VERSION))
    assert [e["event"] for e in logs].count("cdi.driver_version_mismatch") == 1


async def test_the_service_passes_bus_ids_and_the_driver_version(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    for lib in ("libnvidia-ml", "libcuda"):
        driver.host(f"{LIB_DIR}/{lib}.so.{NEW_VERSION}").write_text("stale")
    sysfs = tmp_path / "sys"
    inv = inventory(1)
    driver.add_drm(sysfs, inv.gpus[0], 1)
    service = CdiService(
        config=CdiConfig(),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inv),
        hook_candidates=[],
        sysfs_root=sysfs,
    )
    await service.ensure_device_plugin_spec()
    spec = s.loads(next((tmp_path / "cdi").iterdir()).read_text())
    assert "/dev/dri/card1" in [n.path for n in device(spec, "0").device_nodes]
    assert any(m.container_path == f"{LIB_DIR}/libcuda.so.{VERSION}" for m in spec.container_edits.mounts)
