"""Nothing a user or the kubelet sends may crash the agent.

Property tests: random config documents only ever raise the one-line ConfigError (so the
watcher can always keep the last good config), and random device-ID requests to the device
plugin only ever raise AllocationError (a gRPC status, never INTERNAL).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.backends.simulated import SimulatedBackend
from agent.base.errors import ConfigError
from agent.core.config.loader import build_config
from agent.core.config.schema import HealthConfig, Owner, PluginConfig, TimeSlicingConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.errors import AllocationError
from agent.deviceplugin.resources import plan_resources
from agent.deviceplugin.service import PreferredRequest, ResourceService
from tests.test_plugin_fakes import FakeCdi, ownership_for

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        [
            "auto",
            "nvml",
            "simulated",
            "dra",
            "device-plugin",
            "none",
            "fatal",
            "ignore",
            "count 3 within 60s",
            "127.0.0.1:9477",
            "/abs/path",
            "nvidia.com/gpu",
            "envvar",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), children, max_size=4),
    ),
    max_leaves=12,
)
KEYS = {
    "": [
        "backend",
        "preset",
        "node_name",
        "node_labels",
        "debug_addr",
        "log_level",
        "inventory_refresh_s",
        "paths",
        "health",
        "ownership",
        "plugin",
        "cdi",
    ],
    "paths": ["kubelet_root", "cdi_root", "state_dir", "driver_root"],
    "health": [
        "enabled",
        "check_interval_s",
        "recovery_quiet_s",
        "event_wait_ms",
        "xid_default",
        "xids",
        "reset_required_xids",
        "ecc_double_bit",
        "history_size",
    ],
    "ownership": ["default", "nodes"],
    "plugin": [
        "enabled",
        "resource_name",
        "mig_strategy",
        "device_list_strategy",
        "device_id_strategy",
        "replica_policy",
        "time_slicing",
    ],
    "cdi": ["enabled", "device_plugin_kind", "claim_kind", "reconcile_interval_s"],
}


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(KEYS[""]), max_size=6, unique=True)):
        if key in KEYS and draw(st.booleans()):
            section = {k: draw(values) for k in draw(st.lists(st.sampled_from(KEYS[key]), max_size=4, unique=True))}
            if key == "ownership" and draw(st.booleans()):
                section["nodes"] = [{"match": {"names": ["n"]}, "default": draw(values), "gpus": draw(values)}]
            doc[key] = section
        else:
            doc[key] = draw(values)
    return doc


@settings(max_examples=400, deadline=None)
@given(documents())
def test_config_documents_only_ever_raise_config_error(doc: dict[str, Any]) -> None:
    try:
        build_config(doc)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=12), values, max_size=5))
def test_arbitrary_top_level_keys_are_named(doc: dict[str, Any]) -> None:
    try:
        build_config(doc)
    except ConfigError as exc:
        assert "\n" not in str(exc)


# --- what a kubelet (or anything on its socket) sends the device plugin --------------------


def _service() -> ResourceService:
    inventory = asyncio.run(SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=HealthConfig()).load())
    config = PluginConfig(
        device_list_strategy=("envvar", "cdi-cri"),
        time_slicing=TimeSlicingConfig(replicas=4, fail_requests_greater_than_one=True),
    )
    health = HealthMonitor(config=HealthConfig())
    health.set_inventory(inventory)
    health.observe(Signal(uuid=inventory.gpus[5].uuid, kind=SignalKind.LOST))  # one unhealthy GPU
    (resource,) = plan_resources(inventory, config).resources
    return ResourceService(
        resource=resource,
        config=config,
        inventory=inventory,
        ownership=OwnershipState(ownership_for(inventory, {"7": Owner.DRA})),  # one GPU not ours
        health=health,
        cdi=FakeCdi(),
    )


SERVICE = _service()
VALID = [d.id for d in SERVICE.resource.devices]
ids = st.lists(st.one_of(st.sampled_from(VALID), st.text(max_size=70)), max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(ids, max_size=3))
def test_allocate_refuses_with_allocation_errors_only(requests: list[list[str]]) -> None:
    try:
        answers = asyncio.run(SERVICE.allocate(requests))
    except AllocationError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert len(answers) == len(requests)


@settings(max_examples=300, deadline=None)
@given(ids, ids, st.integers(min_value=-3, max_value=80))
def test_preferred_allocation_refuses_with_allocation_errors_only(
    available: list[str], must: list[str], size: int
) -> None:
    try:
        (answer,) = SERVICE.preferred([PreferredRequest(available=available, must_include=must, size=size)])
    except AllocationError as exc:
        assert str(exc)
    else:
        assert len(answer) == size and set(must) <= set(answer) <= set(available)
