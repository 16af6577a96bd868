"""Driver discovery and spec generation on a fake driver root built in a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.cdi import generate
from agent.cdi import spec as s
from agent.cdi.discovery import DriverDiscovery, DriverFiles, resolve_in_root
from agent.cdi.errors import DriverDiscoveryError, UnknownCdiDeviceError
from tests.cdi_fixtures import LIB_DIR, NEW_VERSION, VERSION, FakeDriver, fake_hook, inventory, mig, node_numbers

KIND = "k8s.gpu-node-agent.nvidia.com/gpu"
CLAIM_KIND = "k8s.gpu-node-agent.nvidia.com/claim"
NUMBERS = {"/dev/nvidiactl": (195, 255), "/dev/nvidia0": (195, 0), "/dev/nvidia1": (195, 1)}


def discover(driver: FakeDriver, hook: Path | None = None) -> DriverFiles:
    discovery = DriverDiscovery(driver.root, hook_candidates=[hook] if hook else [], machine="x86_64")
    return discovery.discover(driver.gpu_minors, driver.cap_minors)


def test_finds_every_piece_through_the_linker_cache(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root", numbers=NUMBERS).build()
    files = discover(driver, fake_hook(tmp_path / "bin"))
    assert files.version == VERSION
    assert files.dev_root == driver.root
    mounts = {m.container_path: m for m in files.mounts}
    for lib in ("libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm"):
        assert f"{LIB_DIR}/{lib}.so.{VERSION}" in mounts
    assert not any("libz" in p for p in mounts)  # not the driver's
    assert f"{LIB_DIR}/libcuda.so.1" not in mounts  # the ldcache hook makes SONAME links
    assert "/usr/bin/nvidia-smi" in mounts
    assert f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin" in mounts
    assert "noexec" in mounts["/run/nvidia-persistenced/socket"].options
    assert mounts[f"{LIB_DIR}/libcuda.so.{VERSION}"].host_path == str(driver.host(f"{LIB_DIR}/libcuda.so.{VERSION}"))
    ctl = files.control_nodes[0]
    assert ctl.path == "/dev/nvidiactl" and ctl.host_path == str(driver.host("/dev/nvidiactl"))
    assert (ctl.major, ctl.minor) == node_numbers(driver.host("/dev/nvidiactl"))
    assert sorted(files.gpu_nodes) == [0, 1]
    hooks = [h.args[1:] for h in files.hooks]
    assert ("create-symlinks", "--link", f"libcuda.so.1::{LIB_DIR}/libcuda.so") in hooks
    assert ("update-ldcache", "--folder", LIB_DIR) in hooks


def test_scans_library_dirs_without_a_cache_and_mounts_links_without_a_hook(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root", with_cache=False).build()
    files = discover(driver)
    paths = {m.container_path for m in files.mounts}
    assert f"{LIB_DIR}/libcuda.so.{VERSION}" in paths
    assert f"{LIB_DIR}/libcuda.so.1" in paths  # no hook: the link arrives as a file
    assert files.hooks == ()


def test_nvidia_ctk_hook_gets_the_hook_subcommand(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    ctk = tmp_path / "bin" / "nvidia-ctk"
    ctk.parent.mkdir()
    ctk.write_text("#!/bin/sh\n")
    ctk.chmod(0o755)
    files = discover(driver, ctk)
    assert all(h.args[:2] == ("nvidia-ctk", "hook") and h.path == str(ctk) for h in files.hooks)


def test_missing_driver_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DriverDiscoveryError, match=f"driver root {tmp_path / 'nope'} does not exist"):
        DriverDiscovery(tmp_path / "nope").discover()


def test_two_driver_versions_are_an_error(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    driver.host(f"{LIB_DIR}/libnvidia-ml.so.{NEW_VERSION}").write_text("other")
    with pytest.raises(DriverDiscoveryError, match=f"more than one NVIDIA driver version.*{VERSION}, {NEW_VERSION}"):
        discover(driver)


def test_no_driver_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    with pytest.raises(DriverDiscoveryError, match="no NVIDIA driver libraries"):
        DriverDiscovery(tmp_path / "root").discover()


def test_missing_required_library_names_it(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    driver.host(f"{LIB_DIR}/libcuda.so.{VERSION}").unlink()
    with pytest.raises(DriverDiscoveryError, match=f"libcuda.so.{VERSION} not found in {driver.host(LIB_DIR)}"):
        discover(driver)


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this host has a real NVIDIA driver")
def test_missing_control_node_names_the_path(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    driver.host("/dev/nvidiactl").unlink()  # so the device root falls back to the host's /dev
    with pytest.raises(DriverDiscoveryError, match="required device node /dev/nvidiactl is missing"):
        discover(driver)


def test_optional_pieces_are_logged_once(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root", with_extras=False).build()
    discovery = DriverDiscovery(driver.root, hook_candidates=[], machine="x86_64")
    with capture_logs() as first:
        files = discovery.discover([0, 1])
    with capture_logs() as second:
        discovery.discover([0, 1])
    missing = {e["path"] for e in first if e["event"] == "cdi.optional_missing"}
    assert str(driver.host("/dev/nvidia-uvm")) in missing
    assert str(driver.host("/run/nvidia-persistenced/socket")) in missing
    assert set(files.missing) == missing
    assert not [e for e in second if e["event"] == "cdi.optional_missing"]


def test_absolute_symlinks_resolve_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib64/real.so").write_text("x")
    os.symlink("/usr/lib64/real.so", root / "usr/lib64/link.so")
    assert resolve_in_root(root, "/usr/lib64/link.so") == "/usr/lib64/real.so"
    assert resolve_in_root(root, "/usr/lib64/missing.so") is None


# --- generation --------------------------------------------------------------------------


def test_device_plugin_spec_names_and_minimum_version(tmp_path: Path) -> None:
    migs = {1: (mig(1, 0, 21, 22), mig(1, 1, 30, 31))}
    driver = FakeDriver(tmp_path / "root", cap_minors=(21, 22, 30, 31)).build()
    inv = inventory(2, migs=migs)
    files = DriverDiscovery(driver.root, hook_candidates=[]).discover(
        generate.gpu_minors(inv), generate.cap_minors(inv)
    )
    result = generate.device_plugin_spec(KIND, inv, files)
    assert result.spec is not None and result.skipped == ()
    g0, g1 = inv.gpus
    m0, m1 = g1.mig_devices
    assert result.spec.device_names == (g0.uuid, "0", g1.uuid, "1", m0.uuid, "1:0", m1.uuid, "1:1", "all")
    assert result.spec.version == s.minimum_version(result.spec) == "0.5.0"
    assert s.validate(result.spec) == []
    by_name = {d.name: d for d in result.spec.devices}
    assert [n.path for n in by_name["1:1"].container_edits.device_nodes] == [
        "/dev/nvidia1",
        "/dev/nvidia-caps/nvidia-cap30",
        "/dev/nvidia-caps/nvidia-cap31",
    ]
    assert len(by_name["all"].container_edits.device_nodes) == 6
    assert result.names[m1.uuid] == m1.uuid and result.names["1:1"] == "1:1"


def test_gone_gpu_is_left_out(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    driver.host("/dev/nvidia1").unlink()
    inv = inventory(2)
    result = generate.device_plugin_spec(KIND, inv, discover(driver))
    assert result.spec is not None
    assert inv.gpus[1].uuid not in result.spec.device_names and "1" not in result.spec.device_names
    assert result.skipped and result.skipped[0].startswith(inv.gpus[1].uuid)
    paths = {n.path for d in result.spec.devices for n in d.container_edits.device_nodes}
    assert "/dev/nvidia1" not in paths


def test_no_gpus_means_no_spec(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    assert generate.device_plugin_spec(KIND, inventory(0), discover(driver)).spec is None


def test_claim_spec(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "root").build()
    inv = inventory(2)
    uid = "9a8b7c6d-0000-1111-2222-333344445555"
    result = generate.claim_spec(CLAIM_KIND, uid, [inv.gpus[1].uuid, "0"], inv, discover(driver))
    assert result.spec is not None
    assert result.spec.device_names == (f"{uid}-{inv.gpus[1].uuid}", f"{uid}-0")
    assert result.spec.version == s.minimum_version(result.spec)
    assert result.spec.container_edits.mounts  # self-contained: carries the driver's common edits
    with pytest.raises(UnknownCdiDeviceError):
        generate.claim_spec(CLAIM_KIND, uid, ["GPU-nope"], inv, discover(driver))
