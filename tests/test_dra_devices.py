"""DRA device names, attributes and capacity: what a slice publishes and a claim names."""

from __future__ import annotations

import re

import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig
from agent.dra.devices import PCIE_ROOT_ATTRIBUTE, binary_quantity, dra_devices, semver

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


async def _devices(preset: str) -> list:  # type: ignore[type-arg]
    inventory = await SimulatedBackend(preset=preset, node_name="n", health=HealthConfig()).load()
    return dra_devices(inventory)


@pytest.mark.parametrize("preset", ["h100-8x-nvlink", "a100-4x-mig", "workstation-2x-pcie"])
async def test_devices_satisfy_the_apiserver_rules(preset: str) -> None:
    devices = await _devices(preset)
    names = [d.name for d in devices]
    assert len(set(names)) == len(names)
    for device in devices:
        assert DNS_LABEL.fullmatch(device.name), device.name
        assert len(device.attributes) + len(device.capacity) <= 32
        for key, attribute in device.attributes.items():
            ident = key.rpartition("/")[2]
            assert C_IDENTIFIER.fullmatch(ident), key
            assert attribute.kind in ("int", "bool", "string", "version")
            if attribute.kind in ("string", "version"):
                assert len(str(attribute.value).encode()) <= 64
            if attribute.kind == "version":
                assert re.fullmatch(r"\d+\.\d+\.\d+", str(attribute.value))


async def test_a_mig_gpu_is_offered_as_its_mig_devices_only() -> None:
    devices = await _devices("a100-4x-mig")
    by_gpu: dict[str, list[str]] = {}
    for d in devices:
        by_gpu.setdefault(d.gpu_uuid, []).append(d.attributes["type"].value)  # type: ignore[arg-type]
    assert any(kinds and set(kinds) == {"mig"} for kinds in by_gpu.values())
    for kinds in by_gpu.values():
        assert set(kinds) in ({"gpu"}, {"mig"}) and (kinds == ["gpu"] or "gpu" not in kinds)
    mig = next(d for d in devices if d.is_mig)
    assert mig.attributes["parentUUID"].value == mig.gpu_uuid and mig.uuid != mig.gpu_uuid
    assert re.fullmatch(r"gpu-\d+-mig-\d+-\d+", mig.name)


async def test_whole_gpu_attributes_use_nvidias_vocabulary() -> None:
    gpu = (await _devices("h100-8x-nvlink"))[0]
    assert gpu.name == "gpu-0"
    values = {k: a.value for k, a in gpu.attributes.items() if k != PCIE_ROOT_ATTRIBUTE}
    assert (
        values.items()
        >= {
            "type": "gpu",
            "productName": "NVIDIA H100 80GB HBM3",
            "architecture": "Hopper",
            "cudaComputeCapability": "9.0.0",
            "driverVersion": "570.124.6",
            "cudaDriverVersion": "12.8.0",
            "index": 0,
            "minor": 0,
        }.items()
    )
    assert gpu.capacity == {"memory": "81559Mi"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("9.0", "9.0.0"), ("570.124.06", "570.124.6"), ("12", "12.0.0"), ("", None), ("N/A", None), ("1.2.3.4", None)],
)
def test_semver(text: str, expected: str | None) -> None:
    assert semver(text) == expected


@pytest.mark.parametrize(
    ("n", "expected"), [(80 << 30, "80Gi"), (81559 << 20, "81559Mi"), (1536, "1536"), (2048, "2Ki"), (0, "0")]
)
def test_binary_quantity(n: int, expected: str) -> None:
    assert binary_quantity(n) == expected
