"""A real CDI consumer: Debian's podman runs a busybox container with devices from our specs.

The specs come from the agent's own code path (CdiService over a fake driver root whose
nodes have /dev/null's numbers, or over an empty driver root for simulated GPUs, whose
specs are environment variables only). podman only reads /etc/cdi and /var/run/cdi, so each run
happens in a private mount namespace with the test's spec directory bound over /etc/cdi
and an empty one over /var/run/cdi; nothing of the host's CDI setup is seen or changed.
The ``podman`` fixture holds what a root-only machine without a registry needs: vfs storage and
config files in a temporary directory, cgroupfs, runc, no network, ulimits no higher than the
hard limits, and a busybox image imported from a tarball.

Run as root, a missing tool is a failure, since the README promises a real podman run:
.ci/install-podman.sh installs what this needs. Set SKIP_PODMAN_TESTS=1 to skip these tests on
purpose; the skip then names what was missing. Run as an ordinary user they are skipped, saying
so: making device nodes and mount namespaces needs root, and nothing one could install changes that.
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.cdi.names import qualified_name
from agent.cdi.service import CdiService
from agent.core.config.schema import CdiConfig
from agent.core.inventory.current import InventoryState
from tests.cdi_fixtures import CURRENT_SUBCOMMANDS, LIB_DIR, VERSION, FakeDriver, fake_hook, inventory, prepare_claim

pytestmark = pytest.mark.podman

IMAGE = "localhost/gpu-agent-cdi-test:latest"
TOOLS = ("podman", "runc", "unshare", "mount")
BUSYBOX = "/bin/busybox"
RUN_TIMEOUT_S = 60


def _require_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mknod, mount namespaces): runs when the tests run as root, as CI's do")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not Path(BUSYBOX).is_file():
        missing.append(BUSYBOX)
    problem = f"missing {', '.join(missing)} (run .ci/install-podman.sh)" if missing else ""
    if problem:
        if os.environ.get("SKIP_PODMAN_TESTS") == "1":
            pytest.skip(f"{problem}; skipped on purpose (SKIP_PODMAN_TESTS=1)")
        pytest.fail(f"the podman CDI test cannot run: {problem}; or set SKIP_PODMAN_TESTS=1 to skip it", pytrace=False)


def _limit(which: int, cap: int) -> int:
    hard = resource.getrlimit(which)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


@dataclass
class Podman:
    base: Path
    env: dict[str, str]

    def run_in_namespace(self, cdi_dir: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
        """``podman ARGS`` seeing only ``cdi_dir`` as /etc/cdi and nothing in /var/run/cdi."""
        empty = self.base / "empty-cdi"
        empty.mkdir(exist_ok=True)
        script = 'mount --bind "$1" /etc/cdi && mount --bind "$2" /var/run/cdi && shift 2 && exec podman "$@"'
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(cdi_dir), str(empty), *args]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)


def _busybox_tar() -> bytes:
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for directory in ("bin", "etc", "dev", "proc", "sys", "tmp", "root"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(BUSYBOX, arcname="bin/busybox")
        for applet in applets:
            if applet != "busybox":
                info = tarfile.TarInfo(f"bin/{applet}")
                info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(info)
        passwd = b"root:x:0:0:root:/root:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return buf.getvalue()


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    _require_tools()
    base = tmp_path_factory.mktemp("podman")
    made = [p for p in (Path("/etc/cdi"), Path("/var/run/cdi")) if not p.exists()]
    for path in made:  # mount points for the bind mounts; removed again below
        path.mkdir(parents=True)
    nofile = _limit(resource.RLIMIT_NOFILE, 1048576)
    nproc = _limit(resource.RLIMIT_NPROC, int(Path("/proc/sys/kernel/pid_max").read_text()))
    (base / "containers.conf").write_text(
        "[containers]\n"
        'netns = "none"\n'
        'log_driver = "k8s-file"\n'
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        'runtime = "runc"\n'
        f'tmp_dir = "{base / "tmp"}"\n'
    )
    (base / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{base / "graph"}"\nrunroot = "{base / "run"}"\n'
    )
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(base / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(base / "storage.conf"),
    }
    imported = subprocess.run(
        ["podman", "import", "-", IMAGE], input=_busybox_tar(), env=env, capture_output=True, timeout=RUN_TIMEOUT_S
    )
    assert imported.returncode == 0, imported.stderr.decode()
    try:
        yield Podman(base=base, env=env)
    finally:
        for path in made:
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()


CHECK_SCRIPT = f"""
set -e
test -c /dev/nvidia0 && echo "node0 $(stat -c '%t:%T' /dev/nvidia0)"
test -c /dev/nvidiactl && echo "ctl $(stat -c '%t:%T' /dev/nvidiactl)"
test -e /dev/nvidia1 && echo "node1 present" || echo "node1 absent"
echo "env NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"
echo "lib $(cat {LIB_DIR}/libcuda.so.{VERSION})"
echo "smi $(test -x /usr/bin/nvidia-smi && echo ok)"
echo "fw $(cat /lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin)"
test -c /dev/dri/card1 && echo "card $(stat -c '%t:%T' /dev/dri/card1)"
test -e /dev/dri/card2 && echo "card2 present" || echo "card2 absent"
test -d /tmp/nvidia-mps && echo "mps dir"
echo "env $(env | grep '^NVIDIA_CTK_LIBCUDA_DIR=')"
"""


async def test_podman_runs_devices_from_agent_specs(podman: Podman, tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "driver").build()  # every node: c 1:3, like /dev/null
    sysfs = tmp_path / "sys"
    for gpu, card in zip(inventory(2).gpus, (1, 2), strict=True):
        driver.add_drm(sysfs, gpu, card)
    driver.host("/tmp/nvidia-mps").mkdir(parents=True)
    hook_log = tmp_path / "hook.log"
    cdi_dir = tmp_path / "cdi"
    service = CdiService(
        config=CdiConfig(),
        cdi_root=cdi_dir,
        driver_root=driver.root,
        inventory=InventoryState(inventory(2)),
        hook_candidates=[fake_hook(tmp_path / "hook", hook_log, subcommands=CURRENT_SUBCOMMANDS)],
        sysfs_root=sysfs,
    )
    await service.ensure_device_plugin_spec()
    claim_names = await prepare_claim(service, "0e3f1a2b-aaaa-bbbb-cccc-000000000001", [inventory(2).gpus[0].uuid])
    gpu0 = service.device_name(inventory(2).gpus[0].uuid)
    timings: dict[str, float] = {}

    for label, device in (("device-plugin", gpu0), ("claim", claim_names[0])):
        started = time.monotonic()
        result = podman.run_in_namespace(
            cdi_dir, ["run", "--rm", "--network", "none", "--device", device, IMAGE, "sh", "-c", CHECK_SCRIPT]
        )
        timings[label] = time.monotonic() - started
        assert result.returncode == 0, f"{label} {device}: {result.stderr}\n{result.stdout}"
        out = result.stdout.splitlines()
        assert "node0 1:3" in out, out
        assert "ctl 1:3" in out, out
        assert "node1 absent" in out, out  # only the requested GPU
        assert "env NVIDIA_VISIBLE_DEVICES=void" in out, out
        assert f"lib libcuda {VERSION}" in out, out
        assert "smi ok" in out, out
        assert "fw firmware" in out, out
        assert "card 1:3" in out and "card2 absent" in out, out  # the GPU's DRM node, not the other's
        assert "mps dir" in out and f"env NVIDIA_CTK_LIBCUDA_DIR={LIB_DIR}" in out, out
    hooks = hook_log.read_text().splitlines()
    assert any(line.startswith("update-ldcache --folder") for line in hooks), hooks
    assert f"enable-cuda-compat --host-driver-version={VERSION}" in hooks, hooks
    assert "disable-device-node-modification" in hooks, hooks
    assert "create-symlinks --link ../card1::/dev/dri/by-path/pci-0000:18:00.0-card" in " ".join(hooks), hooks
    print(f"podman run timings: {timings}")


SIMULATED_CHECK_SCRIPT = """
set -e
env | grep '^GPU_AGENT_SIMULATED' | sort
ls /dev | grep -c '^nvidia' || true
"""


async def test_podman_runs_simulated_devices(podman: Podman, tmp_path: Path) -> None:
    """Simulated GPUs on a node without a driver: the env-only spec resolves and its env arrives."""
    empty_root = tmp_path / "root"  # exists, holds no NVIDIA driver: env-only specs
    empty_root.mkdir()
    cdi_dir = tmp_path / "cdi"
    inv = inventory(2)
    service = CdiService(config=CdiConfig(), cdi_root=cdi_dir, driver_root=empty_root, inventory=InventoryState(inv))
    await service.ensure_device_plugin_spec()
    g0, g1 = inv.gpus
    claim = await prepare_claim(service, "0e3f1a2b-aaaa-bbbb-cccc-000000000002", [g0.uuid])
    assert service.debug_state()["driver_mode"] == "simulated"

    cases = {
        "by uuid": ([service.device_name(g1.uuid)], [f"GPU_AGENT_SIMULATED_GPU_1={g1.uuid}"]),
        "by index": ([qualified_name(CdiConfig().device_plugin_kind, "0")], [f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}"]),
        "two devices": (
            [service.device_name(g0.uuid), qualified_name(CdiConfig().device_plugin_kind, "1")],
            [f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}", f"GPU_AGENT_SIMULATED_GPU_1={g1.uuid}"],
        ),
        "all": (
            [qualified_name(CdiConfig().device_plugin_kind, "all")],
            [f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}", f"GPU_AGENT_SIMULATED_GPU_1={g1.uuid}"],
        ),
        "claim": (claim, [f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}"]),
    }
    for label, (devices, device_env) in cases.items():
        flags = [arg for d in devices for arg in ("--device", d)]
        result = podman.run_in_namespace(
            cdi_dir, ["run", "--rm", "--network", "none", *flags, IMAGE, "sh", "-c", SIMULATED_CHECK_SCRIPT]
        )
        assert result.returncode == 0, f"{label} {devices}: {result.stderr}\n{result.stdout}"
        *env, nvidia_nodes = result.stdout.splitlines()
        assert env == sorted(["GPU_AGENT_SIMULATED=true", *device_env]), (label, result.stdout)
        assert nvidia_nodes == "0", (label, result.stdout)  # env only: no device nodes


def test_podman_rejects_unknown_device(podman: Podman, tmp_path: Path) -> None:
    """The negative control: a name no spec defines does not resolve (so the test above means something)."""
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    result = podman.run_in_namespace(
        cdi_dir,
        ["run", "--rm", "--network", "none", "--device", "k8s.gpu-node-agent.nvidia.com/gpu=nope", IMAGE, "true"],
    )
    assert result.returncode != 0
    assert "unresolvable CDI devices" in result.stderr


async def test_podman_runs_devices_when_the_agent_sees_the_driver_elsewhere(podman: Podman, tmp_path: Path) -> None:
    """A pod mounts the host's driver root somewhere else: specs must name the host's paths.

    The agent's view is a link to the driver (standing in for the pod's mount); it is removed
    before podman runs, as the runtime on the host never sees the pod's mounts.
    """
    driver = FakeDriver(tmp_path / "host" / "run" / "nvidia" / "driver").build()
    pod_view = tmp_path / "pod" / "driver-root"
    pod_view.parent.mkdir()
    pod_view.symlink_to(driver.root, target_is_directory=True)
    hook_log = tmp_path / "hook.log"
    cdi_dir = tmp_path / "cdi"
    service = CdiService(
        config=CdiConfig(hook_path=fake_hook(tmp_path / "hook", hook_log)),
        cdi_root=cdi_dir,
        driver_root=pod_view,
        host_driver_root=driver.root,
        inventory=InventoryState(inventory(2)),
        hook_candidates=[],
    )
    await service.ensure_device_plugin_spec()
    pod_view.unlink()
    assert str(pod_view) not in next(cdi_dir.iterdir()).read_text()
    device = service.device_name(inventory(2).gpus[0].uuid)
    result = podman.run_in_namespace(
        cdi_dir, ["run", "--rm", "--network", "none", "--device", device, IMAGE, "sh", "-c", CHECK_SCRIPT]
    )
    assert result.returncode == 0, f"{result.stderr}\n{result.stdout}"
    out = result.stdout.splitlines()
    assert {"node0 1:3", "ctl 1:3", f"lib libcuda {VERSION}", "smi ok", "fw firmware"} <= set(out), out
    assert any(line.startswith("update-ldcache --folder") for line in hook_log.read_text().splitlines())
