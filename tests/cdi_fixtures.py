"""A fake NVIDIA driver root in a temporary directory, inventories that match it, and
one-claim shorthands for the CDI service's batch calls.

Device nodes are made with mknod when the test runs as root; otherwise a node becomes a
symlink to the /dev entry with the same numbers (stat follows it), so unit tests also run
unprivileged. Tests compare spec numbers with ``os.stat`` of the node, never with constants.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.backends import ldcache
from agent.cdi.claimenv import ClaimDevices
from agent.cdi.errors import CdiError
from agent.cdi.service import CdiProvider
from agent.core.inventory.model import Gpu, Inventory, MigDevice

VERSION = "550.54.15"
NEW_VERSION = "555.42.06"
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
DRIVER_LIBS = ("libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler", "libnvidia-nvvm")
SONAMES = {
    "libnvidia-ml": "libnvidia-ml.so.1",
    "libcuda": "libcuda.so.1",
    "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm": "libnvidia-nvvm.so.4",
}
_STANDARD_NODES = {
    (1, 3): "/dev/null",
    (1, 5): "/dev/zero",
    (1, 7): "/dev/full",
    (1, 8): "/dev/random",
    (1, 9): "/dev/urandom",
}
CAN_MKNOD = os.geteuid() == 0 and not os.environ.get("CDI_TEST_NO_MKNOD")  # set it to try the fallback


def make_node(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if CAN_MKNOD:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        return
    os.symlink(_STANDARD_NODES.get((major, minor), "/dev/null"), path)


def node_numbers(path: Path) -> tuple[int, int]:
    st = path.stat()
    return os.major(st.st_rdev), os.minor(st.st_rdev)


@dataclass
class FakeDriver:
    """``root`` looks like a driver container's root: libraries, a linker cache, nodes, firmware."""

    root: Path
    version: str = VERSION
    gpu_minors: tuple[int, ...] = (0, 1)
    cap_minors: tuple[int, ...] = ()
    #: (major, minor) of every node; the default copies /dev/null so a real runtime can use them
    numbers: dict[str, tuple[int, int]] = field(default_factory=dict)
    with_cache: bool = True
    with_extras: bool = True  # utilities, firmware, sockets, optional control nodes

    def build(self) -> FakeDriver:
        self.root.mkdir(parents=True, exist_ok=True)
        self.write_libraries(self.version)
        for path in self.node_paths():
            self.add_node(path)
        if self.with_extras:
            for tool in ("nvidia-smi", "nvidia-debugdump"):
                self._file(f"/usr/bin/{tool}", b"#!/bin/sh\necho fake\n", mode=0o755)
            self.write_firmware(self.version)
            self._file("/run/nvidia-persistenced/socket", b"")
        return self

    def node_paths(self) -> list[str]:
        paths = ["/dev/nvidiactl"]
        if self.with_extras:
            paths += ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        paths += [f"/dev/nvidia{m}" for m in self.gpu_minors]
        paths += [f"/dev/nvidia-caps/nvidia-cap{m}" for m in self.cap_minors]
        return paths

    def add_drm(self, sysfs_root: Path, gpu: Gpu, card: int) -> None:
        """The GPU's DRM nodes (card<N>, renderD<128+N>), their by-path links, and sysfs listing them."""
        drm = sysfs_root / "bus" / "pci" / "devices" / gpu.short_bus_id / "drm"
        for name in (f"card{card}", f"renderD{128 + card}"):
            (drm / name).mkdir(parents=True, exist_ok=True)
            self.add_node(f"/dev/dri/{name}")
        by_path = self.host("/dev/dri/by-path")
        by_path.mkdir(parents=True, exist_ok=True)
        (by_path / f"pci-{gpu.short_bus_id}-card").symlink_to(f"../card{card}")
        (by_path / f"pci-{gpu.short_bus_id}-render").symlink_to(f"../renderD{128 + card}")

    def add_node(self, path: str, numbers: tuple[int, int] | None = None) -> Path:
        host = self.host(path)
        make_node(host, *(numbers or self.numbers.get(path, (1, 3))))
        return host

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def _file(self, path: str, data: bytes, mode: int = 0o644) -> Path:
        host = self.host(path)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
        host.chmod(mode)
        return host

    def write_libraries(self, version: str) -> None:
        lib = self.host(LIB_DIR)
        lib.mkdir(parents=True, exist_ok=True)
        for entry in lib.iterdir():  # an upgrade replaces the previous driver's files
            if entry.name.startswith(DRIVER_LIBS):
                entry.unlink()
        self._file(f"{LIB_DIR}/libz.so.1.2.13", b"not nvidia")
        entries: list[tuple[str, str]] = [("libz.so.1", f"{LIB_DIR}/libz.so.1")]
        if not self.host(f"{LIB_DIR}/libz.so.1").is_symlink():
            os.symlink("libz.so.1.2.13", self.host(f"{LIB_DIR}/libz.so.1"))
        for name in DRIVER_LIBS:
            real = f"{name}.so.{version}"
            self._file(f"{LIB_DIR}/{real}", f"{name} {version}\n".encode())
            os.symlink(real, self.host(f"{LIB_DIR}/{SONAMES[name]}"))
            entries.append((SONAMES[name], f"{LIB_DIR}/{SONAMES[name]}"))
        os.symlink("libcuda.so.1", self.host(f"{LIB_DIR}/libcuda.so"))
        entries.append(("libcuda.so", f"{LIB_DIR}/libcuda.so"))
        if self.with_cache:
            self._file("/etc/ld.so.cache", ldcache.build(entries))

    def write_firmware(self, version: str) -> None:
        for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
            self._file(f"/lib/firmware/nvidia/{version}/{name}", b"firmware")

    def upgrade(self, version: str) -> None:
        """Replace the driver's user-space files with another version's (a driver upgrade)."""
        old = self.version
        self.write_libraries(version)
        for entry in self.host(f"/lib/firmware/nvidia/{old}").glob("*"):
            entry.unlink()
        self.host(f"/lib/firmware/nvidia/{old}").rmdir()
        self.write_firmware(version)
        self.version = version


def gpu(index: int, *, minor: int | None = None, mig: tuple[MigDevice, ...] = ()) -> Gpu:
    return Gpu(
        uuid=f"GPU-0000000{index}-1111-2222-3333-44444444444{index}",
        index=index,
        minor=index if minor is None else minor,
        product_name="NVIDIA H100 80GB HBM3",
        architecture="hopper",
        compute_capability="9.0",
        memory_mib=81559,
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        numa_node=0,
        mig_enabled=bool(mig),
        mig_devices=mig,
    )


def mig(parent_index: int, index: int, gi_cap: int, ci_cap: int) -> MigDevice:
    parent = gpu(parent_index).uuid
    return MigDevice(
        uuid=f"MIG-{parent_index}{index}aaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        parent_uuid=parent,
        index=index,
        gpu_instance_id=index + 1,
        compute_instance_id=0,
        profile="1g.10gb",
        memory_mib=9856,
        gi_cap_minor=gi_cap,
        ci_cap_minor=ci_cap,
    )


def inventory(
    n_gpus: int = 2, *, version: str = VERSION, migs: dict[int, tuple[MigDevice, ...]] | None = None
) -> Inventory:
    migs = migs or {}
    return Inventory(
        backend="simulated",
        driver_version=version,
        cuda_driver_version="12.4",
        gpus=tuple(gpu(i, mig=migs.get(i, ())) for i in range(n_gpus)),
    )


#: the subcommands of a current nvidia-cdi-hook that the agent checks a binary for
CURRENT_SUBCOMMANDS = ("enable-cuda-compat", "disable-device-node-modification")


def fake_hook(
    directory: Path, record: Path | None = None, *, subcommands: tuple[str, ...] = (), name: str = "nvidia-cdi-hook"
) -> Path:
    """An executable stand-in for nvidia-cdi-hook; appends its arguments to ``record``.

    A real binary holds its subcommands' names as strings; ``subcommands`` puts those of the
    newer ones into the script the same way (an older binary: none of them).
    """
    directory.mkdir(parents=True, exist_ok=True)
    hook = directory / name
    body = f'echo "$@" >> {record}\n' if record else ""
    known = f"# subcommands: create-symlinks update-ldcache {' '.join(subcommands)}\n"
    hook.write_text(f"#!/bin/sh\n{known}{body}exit 0\n")
    hook.chmod(0o755)
    return hook


async def prepare_claim(
    cdi: CdiProvider, claim_uid: str, devices: Sequence[str], env: Mapping[str, Sequence[str]] | None = None
) -> list[str]:
    """One claim's spec through :meth:`CdiProvider.prepare_claims`: its qualified names, or its error raised."""
    claim = ClaimDevices(devices=tuple(devices), env={k: tuple(v) for k, v in (env or {}).items()})
    outcome = (await cdi.prepare_claims({claim_uid: claim}))[claim_uid]
    if isinstance(outcome, CdiError):
        raise outcome
    return outcome


async def unprepare_claim(cdi: CdiProvider, claim_uid: str) -> None:
    """One claim's spec removed through :meth:`CdiProvider.unprepare_claims`; its error raised."""
    error = (await cdi.unprepare_claims([claim_uid]))[claim_uid]
    if error is not None:
        raise error
