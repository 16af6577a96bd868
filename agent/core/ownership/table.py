"""Which mechanism owns each physical GPU: the one place both mechanisms ask "is this mine?".

Two tables of the same shape (:class:`OwnershipTable`):

* the **desired** table, a pure function of (inventory, ownership config, node name, node
  labels) — :func:`compute_ownership` — recomputed whenever one of those changes;
* the **granted** table, what the mechanisms may act on. :mod:`agent.core.ownership.handover` derives it from
  the desired table and from what each mechanism still has in use: a GPU moves to its new
  owner only once the old owner no longer uses it. Until then it is *draining*: granted to
  nobody (``owners`` says ``none``) and listed in ``draining`` with where it comes from and
  where it goes. A drain away from the device plugin begins *closing*: the plugin still lists
  the GPU (``owners`` still says ``device-plugin``) while the scheduler's view of the Node is
  brought down, so that no pod the scheduler placed on it meanwhile is turned away.

Mechanisms read only the granted table, through :meth:`OwnershipTable.granted_to`. MIG devices
always belong to their parent's owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from agent.base.feeds import Broadcast
from agent.core.config.schema import NodeMatch, NodeRule, Owner, OwnershipConfig
from agent.core.inventory.model import Inventory


@dataclass(frozen=True, slots=True)
class Drain:
    """A GPU on its way from one owner to another, waiting for the old owner's users to leave."""

    source: Owner
    target: Owner
    #: monotonic time the drain started
    since: float
    #: why it has not completed yet ("" once nothing is known to hold it)
    waiting_for: str = ""
    #: derived at start (or for a GPU that reappeared) from what might hold it, not from a grant
    #: this process made: the source may never have had it, so going back to it is a new grant
    derived: bool = False
    #: the source still serves it (the device plugin lists it and answers Allocate) until the
    #: scheduler no longer counts it on the Node; then the drain proper begins
    closing: bool = False
    #: monotonic time the handover first saw the source no longer advertise it (None: not yet):
    #: only observations made a settle after it count
    withdrawn: float | None = None
    #: it waits for known users (pods, claims), not on a doubt (an answer, a settle, a listing)
    held: bool = False

    @property
    def label(self) -> str:
        return f"draining:{self.source.value}->{self.target.value}"

    @property
    def phase(self) -> str:
        return "closing" if self.closing else "draining"


@dataclass(frozen=True, slots=True)
class OwnershipTable:
    #: config version the table was computed from
    version: str
    #: GPU UUID -> owner, and MIG UUID -> its parent's owner (a draining GPU: ``none``; a closing
    #: one: still ``device-plugin``)
    owners: Mapping[str, Owner] = field(default_factory=dict)
    #: MIG UUID -> parent GPU UUID
    parents: Mapping[str, str] = field(default_factory=dict)
    #: where the node's default came from ("cluster default" or "ownership.nodes[i]")
    node_rule: str = "cluster default"
    #: GPU UUID -> the rule that decided its desired owner (for ``config plan`` and /debug/state)
    rules: Mapping[str, str] = field(default_factory=dict)
    #: the per-GPU overrides by index that decide a GPU's owner: rule (as in ``rules``) -> the GPU
    #: that index names now (NVML renumbers when a GPU falls off the bus; the handover warns)
    index_overrides: Mapping[str, str] = field(default_factory=dict)
    #: GPU UUID -> its drain (granted tables only)
    draining: Mapping[str, Drain] = field(default_factory=dict)
    #: per-GPU overrides that name no GPU on this node: inert until such a GPU appears
    inert_overrides: tuple[str, ...] = ()

    def owner_of(self, uuid: str) -> Owner:
        """The owner of a GPU or MIG device; devices not on the node belong to nobody."""
        return self.owners.get(uuid, Owner.NONE)

    def granted_to(self, uuid: str, owner: Owner) -> bool:
        """Whether ``owner`` may advertise and hand out this GPU or MIG device now.

        The one question both mechanisms ask, for every device they list, publish, allocate
        or prepare; nothing else decides "is this GPU mine". A draining GPU is nobody's; a closing
        one is still the device plugin's.
        """
        drain = self.draining.get(self.parents.get(uuid, uuid))
        return self.owner_of(uuid) is owner and (drain is None or drain.closing)

    def closing(self, uuid: str) -> bool:
        """The device plugin still serves this GPU (or MIG device), but it is on its way out."""
        drain = self.draining.get(self.parents.get(uuid, uuid))
        return drain is not None and drain.closing

    def dra_may_prepare(self, uuid: str) -> bool:
        """Whether DRA may prepare a claim on this device: granted to DRA, or draining away from DRA.

        A drain away from DRA is granted to nobody else, so a claim the scheduler allocated from a
        slice that still listed the device is prepared rather than stranded (the kubelet would
        retry it forever, and the scheduler never allocates it again); the drain then waits for
        that claim like any other.
        """
        drain = self.draining.get(self.parents.get(uuid, uuid))
        if drain is not None:
            return drain.source is Owner.DRA
        return self.owner_of(uuid) is Owner.DRA

    def state_of(self, uuid: str) -> str:
        """What /debug/state shows: the owner, or ``draining:<from>-><to>``."""
        drain = self.draining.get(self.parents.get(uuid, uuid))
        return drain.label if drain is not None else self.owner_of(uuid).value

    def gpus(self) -> list[str]:
        return [u for u in self.owners if u not in self.parents]

    def counts(self) -> dict[Owner, int]:
        """Physical GPUs per owner; draining GPUs count for nobody (see :meth:`drain_count`)."""
        out = dict.fromkeys(Owner, 0)
        for uuid, owner in self.owners.items():
            if uuid not in self.parents and uuid not in self.draining:
                out[owner] += 1
        return out

    def drain_count(self) -> int:
        return len(self.draining)


class _Matched(Protocol):
    @property
    def match(self) -> NodeMatch: ...


R = TypeVar("R", bound=_Matched)
V = TypeVar("V")
V_co = TypeVar("V_co", covariant=True)


class _Rule(Protocol[V_co]):
    """A node rule: ``ownership.nodes[i]`` or ``dra.publish.nodes[i]``."""

    @property
    def match(self) -> NodeMatch: ...

    @property
    def default(self) -> V_co | None: ...

    @property
    def gpus(self) -> Mapping[str, V_co]: ...


def first_match(rules: Sequence[R], node_name: str, node_labels: Mapping[str, str]) -> tuple[int, R] | None:
    """The first rule matching this node, by name or by all its labels: the one matching rule of
    ``ownership.nodes`` and of ``dra.publish.nodes``."""
    for i, rule in enumerate(rules):
        by_name = bool(rule.match.names) and node_name in rule.match.names
        by_labels = bool(rule.match.labels) and all(node_labels.get(k) == v for k, v in rule.match.labels.items())
        if by_name or by_labels:
            return i, rule
    return None


def node_rule_for(
    config: OwnershipConfig, node_name: str, node_labels: Mapping[str, str]
) -> tuple[int, NodeRule] | None:
    """The first ``ownership.nodes`` rule matching this node (by name or by all its labels)."""
    return first_match(config.nodes, node_name, node_labels)


def compute_ownership(
    inventory: Inventory,
    config: OwnershipConfig,
    *,
    node_name: str,
    node_labels: Mapping[str, str],
    version: str,
) -> OwnershipTable:
    """The desired owners: cluster default, then the node rule, then per-GPU overrides.

    A per-GPU override that names no GPU of this node (a GPU that fell off the bus, a rule
    shared by a pool whose nodes have different GPUs, or a typo) is not an error: it is inert
    and listed in ``inert_overrides``, and the rest of the config applies. Overrides by index
    follow whatever GPU holds that index now; :mod:`agent.core.ownership.handover` notices when that changes.
    """
    choice = per_gpu(
        inventory,
        config.nodes,
        config.default,
        section="ownership",
        default_label="cluster default",
        node_name=node_name,
        node_labels=node_labels,
    )
    rule_label = choice.node_rule
    owners: dict[str, Owner] = dict(choice.values)
    rules = choice.rules
    parents: dict[str, str] = {}
    for gpu in inventory.gpus:
        for mig in gpu.mig_devices:
            owners[mig.uuid] = owners[gpu.uuid]
            parents[mig.uuid] = gpu.uuid
    return OwnershipTable(
        version=version,
        owners=owners,
        parents=parents,
        node_rule=rule_label,
        rules=rules,
        index_overrides={where: uuid for uuid, where in rules.items() if where in choice.by_index},
        inert_overrides=choice.inert,
    )


@dataclass(frozen=True, slots=True)
class PerGpu(Generic[V]):
    """One value per GPU of the node, and the rule that chose each."""

    values: dict[str, V]
    rules: dict[str, str]
    #: the node rule that matched ("ownership.nodes[2]"), or the section's default label
    node_rule: str
    #: per-GPU entries naming no GPU of the node, with why they are inert
    inert: tuple[str, ...]
    #: the rules of entries given by index (they follow whatever GPU holds the index)
    by_index: frozenset[str]


def per_gpu(
    inventory: Inventory,
    rules_: Sequence[_Rule[V]],
    default: V,
    *,
    section: str,
    default_label: str,
    node_name: str,
    node_labels: Mapping[str, str],
) -> PerGpu[V]:
    """The value of each GPU: ``default`` (the section's), then the first rule matching the node
    (its default), then that rule's per-GPU entries by UUID or index. An entry that names no GPU of
    this node is inert, not an error. Ownership and ``dra.publish`` both choose this way."""
    default_rule = rule_label = default_label
    entries: Mapping[str, V] = {}
    matched = first_match(rules_, node_name, node_labels)
    if matched is not None:
        index, rule = matched
        rule_label = f"{section}.nodes[{index}]"
        if rule.default is not None:
            default, default_rule = rule.default, f"{rule_label}.default"
        entries = rule.gpus
    values = {gpu.uuid: default for gpu in inventory.gpus}
    rules = {gpu.uuid: default_rule for gpu in inventory.gpus}
    inert: list[str] = []
    by_index: set[str] = set()
    for key, value in entries.items():
        gpu = inventory.find(key)
        where = f"{rule_label}.gpus[{key!r}]"
        if gpu is None:
            inert.append(f"{where}: no GPU with that UUID or index on node {node_name!r}; inert until one appears")
            continue
        values[gpu.uuid], rules[gpu.uuid] = value, where
        if key.isdecimal():
            by_index.add(where)
    return PerGpu(values, rules, rule_label, tuple(inert), frozenset(by_index))


class OwnershipState:
    """Holds the granted table (and the desired one it came from) and announces grant changes.

    Only the handover (or a test) calls :meth:`update`. Constructed with a table and nothing
    else, desired and granted are the same table and the grants count as decided.
    :attr:`decided` is set once the grants of this start are known: at once when the grants made
    from the durable record cover every GPU the config gives the device plugin (``decided=True``),
    else by the handover once no GPU the config gives the device plugin waits on a drain derived
    at start (a doubt, not a holder: usually the slices of an earlier run, not listed yet). The
    device plugin holds its first ListAndWatch answer until then (bounded), so the kubelet never
    hears "no GPUs" from a plugin whose GPUs are a moment away.
    """

    def __init__(self, table: OwnershipTable | None = None, *, decided: bool | None = None) -> None:
        self.current = table or OwnershipTable(version="")
        self.desired = self.current
        self.changes: Broadcast[OwnershipTable] = Broadcast()
        self.decided = asyncio.Event()
        if decided is None:
            decided = table is not None
        if decided:
            self.decided.set()

    def update(self, granted: OwnershipTable, desired: OwnershipTable | None = None, *, decided: bool = True) -> bool:
        """Install a granted table; returns whether any grant changed (and only then publishes).

        ``decided``: this start's grants are known (see :attr:`decided`; never unset)."""
        changed = dict(granted.owners) != dict(self.current.owners) or _phases(granted) != _phases(self.current)
        self.current = granted
        self.desired = desired or granted
        if decided:
            self.decided.set()
        if changed:
            self.changes.publish(granted)
        return changed


def _phases(table: OwnershipTable) -> dict[str, bool]:
    """GPU -> whether its drain is closing, for the GPUs that drain: what the mechanisms act on."""
    return {gpu: drain.closing for gpu, drain in table.draining.items()}
