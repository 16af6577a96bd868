"""Test doubles for the device plugin tests (and bench/bench_plugin.py); holds no tests.

* :class:`FakeKubelet` — the rude kubelet of :mod:`tests.fake_kubelet` (re-exported here).
* :class:`FakeCdi` — the :class:`~agent.deviceplugin.cdinames.CdiNames` the plugin calls.
* :class:`PluginHarness` — a :class:`PluginManager` on the simulated ``h100-8x-nvlink`` node in
  a short temporary kubelet root, with helpers to wait on conditions (never fixed sleeps) and
  to change ownership, plugin config or the inventory the way the agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from agent.backends.simulated import SimulatedBackend
from agent.base.backoff import Backoff
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig
from agent.core.config.schema import Config, HealthConfig, NodeMatch, NodeRule, Owner, OwnershipConfig, PluginConfig
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState, compute_ownership
from agent.deviceplugin.manager import PluginManager
from agent.deviceplugin.server import DEFAULT_REGISTRATION_TIMEOUTS, RegistrationTimeouts
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests.fake_kubelet import FakeKubelet

NODE = "node-a"
PRESET = "h100-8x-nvlink"
FAST_HEALTH = HealthConfig(check_interval_s=0.05, recovery_quiet_s=0.0)
FAST_BACKOFF = Backoff(initial_s=0.05, max_s=0.2)


async def wait_for(condition: Callable[[], object], *, within_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` on the loop until it is truthy; fail after ``within_s`` seconds.

    ``within_s`` only bounds a hang: a loaded CI machine may be slow, a passing test never waits it out.
    """
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def short_tmpdir() -> Any:
    """A temporary directory with a short path (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kr-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class FakeCdi:
    """CdiNames double: names ``k8s.gpu-node-agent.nvidia.com/gpu=<uuid>``."""

    kind: str = "k8s.gpu-node-agent.nvidia.com/gpu"
    ensured: int = 0
    fail: str = ""
    #: when set, ensure_device_plugin_spec announces itself on ``entered`` and waits on it
    gate: asyncio.Event | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)

    def device_name(self, device_uuid: str) -> str:
        return f"{self.kind}={device_uuid}"

    async def ensure_device_plugin_spec(self) -> None:
        if self.fail:
            from agent.base.errors import AgentError

            raise AgentError(self.fail)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.ensured += 1


def loaded(config: Config, version: str = "v1") -> LoadedConfig:
    return LoadedConfig(config=config, version=version, source="test")


def ownership_for(inventory: Inventory, gpus: dict[str, Owner] | None = None, version: str = "1") -> Any:
    config = OwnershipConfig(
        default=Owner.DEVICE_PLUGIN,
        nodes=(NodeRule(match=NodeMatch(names=(NODE,)), gpus=dict(gpus or {})),) if gpus else (),
    )
    return compute_ownership(inventory, config, node_name=NODE, node_labels={}, version=version)


@dataclass
class PluginHarness:
    root: Path
    backend: SimulatedBackend
    inventories: InventoryState
    health: HealthMonitor
    ownership: OwnershipState
    config_state: ConfigState
    cdi: FakeCdi
    kubelet: FakeKubelet
    manager: PluginManager
    task: asyncio.Task[None] | None = None
    _health_task: asyncio.Task[None] | None = None

    @property
    def plugin_dir(self) -> Path:
        return self.root / "device-plugins"

    @property
    def inventory(self) -> Inventory:
        return self.inventories.current

    def socket(self, name: str = "gpu-node-agent-nvidia-gpu.sock") -> Path:
        return self.plugin_dir / name

    def channel(self, name: str = "gpu-node-agent-nvidia-gpu.sock") -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{self.socket(name)}")

    def gpu(self, index: int) -> str:
        gpu = self.inventory.find(str(index))
        assert gpu is not None
        return gpu.uuid

    def set_owner(self, gpus: dict[str, Owner], version: str) -> bool:
        return self.ownership.update(ownership_for(self.inventory, gpus, version))

    def set_inventory(self, inventory: Inventory, version: str, gpus: dict[str, Owner] | None = None) -> None:
        """What the agent's inventory reload does: health, then ownership, then the inventory feed."""
        self.health.set_inventory(inventory)
        self.ownership.update(ownership_for(inventory, gpus, version))
        self.inventories.update(inventory)

    def set_plugin_config(self, plugin: PluginConfig, version: str) -> None:
        self.config_state.accept(loaded(replace(self.config_state.config, plugin=plugin), version))

    async def start(self) -> None:
        self._health_task = asyncio.create_task(self.backend.watch_health(self.inventory, self.health.observe))
        self.task = asyncio.create_task(self.manager.run(), name="plugin-manager")
        await wait_for(lambda: self.backend._emit is not None, what="health watch")

    async def wait_ready(self, within_s: float = 10.0) -> None:
        await wait_for(lambda: self.manager.ready, within_s=within_s, what="manager ready")

    def is_settled(self) -> bool:
        """The agent is done reacting: every server quiet and registered, and the running kubelet
        holds a live ListAndWatch stream of every resource."""
        process = self.kubelet.current
        servers = self.manager.servers
        return (
            process is not None
            and self.manager.ready
            and all(s.quiet for s in servers.values())
            and all(process.holds_live_stream(name) for name in servers)
        )

    async def settled(self, within_s: float = 10.0) -> None:
        await wait_for(self.is_settled, within_s=within_s, what="the plugin to settle, registered")

    async def stop(self) -> None:
        for task in (self.task, self._health_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.kubelet.stop()


@contextlib.asynccontextmanager
async def plugin_harness(
    plugin: PluginConfig | None = None,
    *,
    start_kubelet: bool = True,
    timeouts: RegistrationTimeouts = DEFAULT_REGISTRATION_TIMEOUTS,
    kubelet: Callable[[Path], FakeKubelet] = FakeKubelet,
) -> AsyncIterator[PluginHarness]:
    with short_tmpdir() as root:
        backend = SimulatedBackend(preset=PRESET, node_name=NODE, health=FAST_HEALTH)
        inventory = await backend.load()
        inventories = InventoryState(inventory)
        health = HealthMonitor(config=FAST_HEALTH)
        health.set_inventory(inventory)
        ownership = OwnershipState(ownership_for(inventory))
        config_state = ConfigState(loaded(Config(plugin=plugin or PluginConfig())))
        cdi = FakeCdi()
        fake = kubelet(root / "device-plugins")
        if start_kubelet:
            await fake.start()
        manager = PluginManager(
            config_state=config_state,
            node=NodeFacts(inventory=inventories, health=health, ownership=ownership),
            cdi=cdi,
            plugin_dir=root / "device-plugins",
            backoff=FAST_BACKOFF,  # retries in tens of milliseconds
            timeouts=timeouts,
        )
        harness = PluginHarness(root, backend, inventories, health, ownership, config_state, cdi, fake, manager)
        try:
            await harness.start()
            yield harness
        finally:
            await harness.stop()


async def next_message(call: grpc.aio.UnaryStreamCall, within_s: float = 10.0) -> pb.ListAndWatchResponse:  # type: ignore[type-arg]
    """The next ListAndWatch message; fails if the stream ends or stays silent."""
    message = await asyncio.wait_for(call.read(), within_s)
    assert message is not grpc.aio.EOF, "ListAndWatch ended"
    return message  # type: ignore[return-value]


def ids_of(message: pb.ListAndWatchResponse) -> list[str]:
    return [d.ID for d in message.devices]
