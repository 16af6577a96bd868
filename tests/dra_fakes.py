"""Test doubles for the DRA kubelet-plugin tests (and bench/bench_dra.py); holds no tests.

* :class:`FakeClaimSource` — the API server's ResourceClaims, as rude as the real one can be:
  claims that are missing, re-created under another UID, not allocated, allocated elsewhere;
  an API that fails (KubeError) or hangs.
* :class:`FakePublisher` — the ResourceSlice publisher's interface, publishing nothing itself.
* :class:`FakeKubelet` — the kubelet's plugin watcher on the registration socket, through
  grpcio like the real (Go) kubelet: GetInfo with a 1 s deadline, then NotifyRegistrationStatus.
* :class:`DraHarness` — the DRA mechanism on a simulated node in a short temporary root, with
  the real CDI service (env-only specs for simulated GPUs) and grpcio stubs for the kubelet;
  with ``mig=True`` its GPUs are MIG-capable H100s whose instances a
  :class:`~tests.partition_fakes.FakeMig` makes, and shares run under a
  :class:`~tests.partition_fakes.FakeMps`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from agent.backends.simulated import SimulatedBackend
from agent.cdi.service import CdiService, create_cdi_service
from agent.core.config.loader import build_config
from agent.core.config.schema import Config, HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.mechanism import Readiness
from agent.core.node import NodeFacts
from agent.core.ownership.publish import PublishState, compute_publish_modes
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.core.partitioning import NoMig
from agent.dra.claims.driver import PrepareTimeouts
from agent.dra.mechanism import DraMechanism, DraTuning, build_dra
from agent.dra.modes import ModeGate
from agent.kube.claims.model import ClaimRef, DeviceResult, OpaqueConfig, PodRef, ResourceClaim
from agent.kube.errors import KubeError
from tests._grpcio import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    drahealth_v1alpha1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from tests.partition_fakes import FakeMig, FakeMps, mig_capable
from tests.test_ownership import granted_gpus
from tests.test_plugin_fakes import FAST_BACKOFF, short_tmpdir, wait_for

NODE = "node-a"
DRIVER = "gpu-node-agent.nvidia.com"
BOOT = "boot-1"
FAST = DraTuning(timeouts=PrepareTimeouts(api_s=0.3, lock_s=1.0, held_s=0.05), backoff=FAST_BACKOFF)
HEALTH = HealthConfig(check_interval_s=0.05, recovery_quiet_s=0.0)


def result(
    device: str,
    request: str = "gpu",
    *,
    driver: str = DRIVER,
    pool: str = NODE,
    share_id: str | None = None,
    admin: bool = False,
    memory: str | None = None,
) -> DeviceResult:
    consumed = {"memory": memory} if memory is not None else {}
    return DeviceResult(
        request=request,
        driver=driver,
        pool=pool,
        device=device,
        share_id=share_id,
        admin_access=admin,
        consumed=consumed,
    )


def gpu_config(env: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu-node-agent.nvidia.com/v1alpha1", "kind": "GpuConfig", "env": env or {}, **extra}


def opaque(
    parameters: Any, *, source: str = "FromClaim", requests: Iterable[str] = (), driver: str = DRIVER
) -> OpaqueConfig:
    return OpaqueConfig(source=source, driver=driver, requests=tuple(requests), parameters=parameters)


class FakeClaimSource:
    """ResourceClaims by (namespace, name). ``down`` makes every read fail, ``hang`` never answer."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], ResourceClaim] = {}
        self.calls: list[ClaimRef] = []
        self.down = ""
        self.hang = False
        #: set when a read is waiting on ``hang``
        self.hanging = asyncio.Event()

    def add(
        self,
        name: str,
        *results: DeviceResult,
        namespace: str = "default",
        uid: str | None = None,
        allocated: bool = True,
        configs: Iterable[OpaqueConfig] = (),
        allocation_timestamp: str | None = None,
        reserved_for: Iterable[PodRef] = (),
    ) -> ClaimRef:
        uid = uid or f"uid-{namespace}-{name}"
        self.claims[(namespace, name)] = ResourceClaim(
            namespace=namespace,
            name=name,
            uid=uid,
            allocated=allocated,
            results=tuple(results),
            configs=tuple(configs),
            api_version="resource.k8s.io/v1",
            allocation_timestamp=allocation_timestamp,
            reserved_for=tuple(reserved_for),
        )
        return ClaimRef(namespace=namespace, name=name, uid=uid)

    async def get_claim(self, ref: ClaimRef) -> ResourceClaim | None:
        self.calls.append(ref)
        if self.hang:
            self.hanging.set()
            await asyncio.Event().wait()
        if self.down:
            raise KubeError(self.down, status=503, recoverable=True)
        await asyncio.sleep(0)  # a real read always yields
        return self.claims.get((ref.namespace, ref.name))


@dataclass
class FakePublisher:
    ownership: OwnershipState
    kicks: int = 0
    resyncs: int = 0
    #: what slice_check answers (None: unknown)
    check: tuple[frozenset[str], frozenset[str]] | None = None
    ready: Readiness = field(default_factory=lambda: Readiness(True))
    running: bool = False

    async def run(self) -> None:
        self.running = True
        try:
            await asyncio.Event().wait()
        finally:
            self.running = False

    def published_gpus(self) -> frozenset[str]:
        return granted_gpus(self.ownership.current, Owner.DRA)

    def kick(self) -> None:
        self.kicks += 1

    def resync(self) -> None:
        self.resyncs += 1
        self.kick()

    def slice_check(self) -> tuple[frozenset[str], frozenset[str]] | None:
        return self.check

    def readiness(self) -> Readiness:
        return self.ready

    def debug_state(self) -> dict[str, object]:
        return {"fake": True, "kicks": self.kicks}


class FakeKubelet:
    """The plugin watcher's side of registration (grpcio), like kubelet 1.34."""

    def __init__(self, registration_socket: Path) -> None:
        self.socket = registration_socket

    async def register(self, *, accept: bool = True, reason: str = "") -> pluginregistration_v1_pb2.PluginInfo:
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
            stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(pluginregistration_v1_pb2.InfoRequest(), timeout=1.0)
            status = pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=accept, error=reason)
            await stub.NotifyRegistrationStatus(status, timeout=5.0)
        return info


def ownership_table(inventory: Inventory, gpus: dict[str, Owner] | None = None, version: str = "1") -> Any:
    """Everything to DRA, except per-GPU overrides (by UUID or index)."""
    config = OwnershipConfig(
        default=Owner.DRA,
        nodes=(NodeRule(match=NodeMatch(names=(NODE,)), gpus=dict(gpus or {})),) if gpus else (),
    )
    return compute_ownership(inventory, config, node_name=NODE, node_labels={}, version=version)


def make_config(root: Path, **overrides: Any) -> Config:
    document: dict[str, Any] = {
        "node_name": NODE,
        "paths": {
            "kubelet_root": str(root / "kubelet"),
            "cdi_root": str(root / "cdi"),
            "driver_root": str(root / "driver"),
        },
    }
    return build_config(document, overrides)


@dataclass
class DraHarness:
    root: Path
    config: Config
    inventories: InventoryState
    health: HealthMonitor
    ownership: OwnershipState
    claims: FakeClaimSource
    publisher: FakePublisher
    boot_id: str = BOOT
    tuning: DraTuning = FAST
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    cdi: CdiService | None = None
    mechanism: DraMechanism | None = None
    task: asyncio.Task[None] | None = None
    #: dynamic MIG: the hardware's instances (None: the node cannot make any)
    mig: FakeMig | None = None
    mps: FakeMps | None = None
    publish: PublishState = field(default_factory=PublishState)
    owners: dict[str, Owner] = field(default_factory=dict)
    reloads: int = 0

    # --- paths and peers -------------------------------------------------------------------

    @property
    def dra_socket(self) -> Path:
        return self.config.dra_plugin_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.config.paths.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    @property
    def cdi_root(self) -> Path:
        return self.config.paths.cdi_root

    @property
    def checkpoint(self) -> Path:
        return self.config.state_dir / "checkpoint.json"

    @property
    def m(self) -> DraMechanism:
        assert self.mechanism is not None
        return self.mechanism

    @property
    def inventory(self) -> Inventory:
        return self.inventories.current

    def kubelet(self) -> FakeKubelet:
        return FakeKubelet(self.registration_socket)

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{self.dra_socket}")

    def claim_specs(self) -> set[str]:
        """Claim UIDs with a transient CDI spec on disk."""
        prefix = "k8s.gpu-node-agent.nvidia.com-claim_"
        if not self.cdi_root.exists():
            return set()
        return {p.name[len(prefix) : -len(".json")] for p in self.cdi_root.glob(f"{prefix}*.json")}

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels or None) or 0.0

    # --- the node ----------------------------------------------------------------------------

    def gpu(self, index: int) -> str:
        gpu = self.inventory.find(str(index))
        assert gpu is not None
        return gpu.uuid

    def set_owner(self, gpus: dict[str, Owner], version: str) -> bool:
        self.owners = dict(gpus)
        return self.ownership.update(ownership_table(self.inventory, gpus, version))

    def set_publish(self, publish: Any, **sharing: Any) -> bool:
        """``dra.publish`` as a config file says it (a mode, or a mapping with rules), and
        ``dra.sharing`` fields, reloaded live."""
        document = _plain(self.config)
        document["dra"]["publish"] = publish
        document["dra"]["sharing"].update(sharing)
        self.config = build_config(document)
        return self.publish.update(
            compute_publish_modes(self.inventory, self.config.dra, node_name=NODE, node_labels={})
        )

    async def reload(self) -> None:
        """The backend read again: the MIG instances that exist now appear in the inventory."""
        self.reloads += 1
        if self.mig is None:
            return
        inventory = self.mig.inventory()
        self.health.set_inventory(inventory)
        self.ownership.update(ownership_table(inventory, self.owners, "reload"))
        self.inventories.update(inventory)

    def fault(self, uuid: str, *, healthy: bool = False) -> None:
        kind = SignalKind.INJECTED_HEAL if healthy else SignalKind.INJECTED_FAULT
        self.health.observe(Signal(uuid=uuid, kind=kind, detail="test"))

    # --- lifecycle ---------------------------------------------------------------------------

    async def build(self) -> DraMechanism:
        """What the agent does at start: a CDI service, then the DRA mechanism (checkpoint restored)."""
        self.registry = CollectorRegistry()
        cdi = create_cdi_service(self.config, inventory=self.inventories, registry=self.registry)
        assert isinstance(cdi, CdiService)
        self.cdi = cdi
        gate = ModeGate(inventory=self.inventories, publish=self.publish)
        self.mechanism = await build_dra(
            self.config,
            claims=self.claims,
            publisher=self.publisher,
            node=NodeFacts(inventory=self.inventories, health=self.health, ownership=self.ownership),
            cdi=cdi,
            registry=self.registry,
            node_name=NODE,
            boot_id=self.boot_id,
            tuning=self.tuning,
            gate=gate,
            mig=self.mig or NoMig(),
            mps=self.mps,
        )
        self.mechanism.driver.set_inventory_reload(self.reload)
        return self.mechanism

    async def start(self) -> None:
        if self.mechanism is None:
            await self.build()
        self.task = asyncio.create_task(self.m.run(), name="dra-mechanism")
        await wait_for(lambda: self.m.plugin.running, what="DRA plugin serving")

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def restart(self, **changes: Any) -> None:
        """An agent restart on the same directories: everything in memory is rebuilt."""
        await self.stop()
        for key, value in changes.items():
            setattr(self, key, value)
        self.mechanism = None
        await self.start()

    # --- the kubelet's DRA calls -------------------------------------------------------------

    async def prepare(self, *refs: ClaimRef, api: str = "v1") -> Any:
        pb, grpc_mod = (dra_v1_pb2, dra_v1_pb2_grpc) if api == "v1" else (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]
        )
        async with self.channel() as channel:
            return await grpc_mod.DRAPluginStub(channel).NodePrepareResources(request, timeout=45)

    async def unprepare(self, *refs: ClaimRef, api: str = "v1") -> Any:
        pb, grpc_mod = (dra_v1_pb2, dra_v1_pb2_grpc) if api == "v1" else (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc)
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]
        )
        async with self.channel() as channel:
            return await grpc_mod.DRAPluginStub(channel).NodeUnprepareResources(request, timeout=45)

    def health_stub(self, channel: grpc.aio.Channel) -> drahealth_v1alpha1_pb2_grpc.DRAResourceHealthStub:
        return drahealth_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel)


@contextlib.asynccontextmanager
async def dra_harness(
    *,
    preset: str = "h100-8x-nvlink",
    start: bool = True,
    tuning: DraTuning = FAST,
    mig: bool = False,
    mig_enabled: bool | Iterable[int] = True,
    mig_architecture: str = "",
    publish: Any = None,
    **config: Any,
) -> AsyncIterator[DraHarness]:
    with short_tmpdir() as root:
        (root / "driver").mkdir()  # no driver files: simulated GPUs get env-only CDI specs
        backend = SimulatedBackend(preset=preset, node_name=NODE, health=HEALTH)
        inventory = await backend.load()
        if mig and isinstance(mig_enabled, bool):
            inventory = mig_capable(inventory, enabled=mig_enabled, architecture=mig_architecture)
        elif mig:  # the GPUs at these indexes are in MIG mode, the others can do MIG but are not
            on = set(mig_enabled)
            inventory = mig_capable(mig_capable(inventory, enabled=False, architecture=mig_architecture), indexes=on)
        health = HealthMonitor(config=HEALTH)
        health.set_inventory(inventory)
        ownership = OwnershipState(ownership_table(inventory))
        harness = DraHarness(
            root=root,
            config=make_config(root, **config),
            inventories=InventoryState(inventory),
            health=health,
            ownership=ownership,
            claims=FakeClaimSource(),
            publisher=FakePublisher(ownership),
            tuning=tuning,
            mig=FakeMig(inventory) if mig else None,
            mps=FakeMps(root / "mps"),
        )
        if publish is not None:
            harness.set_publish(publish)
        try:
            if start:
                await harness.start()
            yield harness
        finally:
            await harness.stop()


def answer(response: Any, uid: str) -> list[tuple[tuple[str, ...], str, str, tuple[str, ...]]]:
    """One claim's devices as comparable tuples (request names, pool, device, CDI IDs)."""
    entry = response.claims[uid]
    assert entry.error == "", entry.error
    return [(tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids)) for d in entry.devices]


def _plain(config: Config) -> dict[str, Any]:
    """A config as the document it could have been read from."""
    from agent.core.config.loader import to_plain

    document: dict[str, Any] = to_plain(config)
    return document
