"""``dra.publish``: the wished publish mode per GPU, matched like ownership, and its change feed."""

from __future__ import annotations

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import PublishMode
from agent.core.ownership.publish import PublishState, compute_publish_modes
from tests.test_ownership import _inventory

RULES = {
    "default": "whole",
    "nodes": [
        {"match": {"names": ["n1"]}, "gpus": {"1": "shared"}},  # no default: the section's stays
        {"match": {"labels": {"pool": "mig"}}, "default": "dynamic-mig", "gpus": {"GPU-2": "whole", "9": "shared"}},
    ],
}


@pytest.mark.parametrize(
    ("node", "labels", "modes", "rule"),
    [
        ("n1", {"pool": "mig"}, ["whole", "shared", "whole", "whole"], "dra.publish.nodes[0].gpus['1']"),
        ("n2", {"pool": "mig"}, ["dynamic-mig", "dynamic-mig", "whole", "dynamic-mig"], "dra.publish.nodes[1].default"),
        ("n3", {}, ["whole"] * 4, "dra.publish.default"),
    ],
    ids=["by-name-first", "by-labels", "unmatched"],
)
def test_first_matching_rule_then_per_gpu_entries(
    node: str, labels: dict[str, str], modes: list[str], rule: str
) -> None:
    table = compute_publish_modes(
        _inventory(), build_config({"dra": {"publish": RULES}}).dra, node_name=node, node_labels=labels
    )
    assert [table.mode_of(f"GPU-{i}").value for i in range(4)] == modes
    assert table.rules["GPU-1"] == rule
    assert table.mode_of("GPU-not-here") is PublishMode.WHOLE


def test_an_entry_naming_no_gpu_is_inert_not_an_error() -> None:
    table = compute_publish_modes(
        _inventory(), build_config({"dra": {"publish": RULES}}).dra, node_name="n2", node_labels={"pool": "mig"}
    )
    assert table.inert == (
        "dra.publish.nodes[1].gpus['9']: no GPU with that UUID or index on node 'n2'; inert until one appears",
    )
    assert table.rules["GPU-2"] == "dra.publish.nodes[1].gpus['GPU-2']"


def test_the_feed_fires_when_a_mode_or_the_sharing_settings_change() -> None:
    inventory = _inventory()
    state = PublishState()
    with state.changes.subscribe() as changes:
        first = compute_publish_modes(inventory, build_config({}).dra, node_name="n", node_labels={})
        assert state.update(first)  # from the empty table
        assert not state.update(compute_publish_modes(inventory, build_config({}).dra, node_name="n", node_labels={}))
        mps = build_config({"dra": {"sharing": {"mps": True}}}).dra
        assert state.update(compute_publish_modes(inventory, mps, node_name="n", node_labels={}))
        assert len(changes.drain()) == 2
