"""Registration state without sockets: the decision table and the kubelet link."""

from __future__ import annotations

import pytest

from agent.deviceplugin.link import MAX_KUBELET_CONNECTIONS, KubeletLink
from agent.deviceplugin.registration import Action, Observation, decide

NOW = 100.0


def seen(**changes: object) -> Observation:
    """A registered, healthy server; ``changes`` say what differs."""
    base: dict[str, object] = {
        "now": NOW,
        "serving": True,
        "socket_present": True,
        "kubelet_stream_open": True,
        "accepted": True,
        "stream_seen": True,
    }
    base.update(changes)
    return Observation(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("observation", "action", "reason", "until"),
    [
        (seen(), Action.IDLE, "", None),
        # the kubelet holds our stream: registered, whatever else looks odd
        (seen(socket_present=False), Action.IDLE, "", None),
        (seen(retry_at=NOW + 5), Action.IDLE, "", None),
        (seen(serving=False, kubelet_stream_open=False), Action.START, "not serving", None),
        (seen(serving=False, retry_at=NOW + 1), Action.WAIT, "", NOW + 1),
        (seen(serving=False, retry_at=NOW - 1), Action.START, "not serving", None),
        (seen(kubelet_stream_open=False, socket_present=False), Action.RESTART, "own socket deleted or replaced", None),
        # restart even while a retry waits: the retry was for a run that lost its socket
        (seen(kubelet_stream_open=False, socket_present=False, retry_at=NOW + 9), Action.RESTART, "own", None),
        # Register accepted, the kubelet's ListAndWatch not there yet: wait for it, do not register again
        (seen(kubelet_stream_open=False, stream_seen=False, stream_deadline=NOW + 2), Action.WAIT, "", NOW + 2),
        (
            seen(kubelet_stream_open=False, stream_seen=False, stream_deadline=NOW),
            Action.REGISTER,
            "the kubelet opened no ListAndWatch stream after Register",
            None,
        ),
        (seen(kubelet_stream_open=False), Action.REGISTER, "the kubelet ended our ListAndWatch stream", None),
        (seen(kubelet_stream_open=False, accepted=False, stream_seen=False), Action.REGISTER, "not registered", None),
        (seen(kubelet_stream_open=False, accepted=False, retry_at=NOW + 3), Action.WAIT, "", NOW + 3),
    ],
)
def test_decision_table(observation: Observation, action: Action, reason: str, until: float | None) -> None:
    step = decide(observation)
    assert step.action is action
    assert step.reason.startswith(reason)
    assert step.until == until


KUBELET, OTHER = "kubelet-connection", "other-connection"


def registered_link(changes: list[str]) -> tuple[KubeletLink, int]:
    link = KubeletLink(on_change=lambda: changes.append("change"), wall_clock=lambda: 1_700_000_000.0)
    link.register_started()
    link.options_requested(KUBELET)  # the kubelet dials us inside Register
    link.register_finished(accepted=True)
    return link, link.stream_opened(KUBELET)


def test_the_kubelets_stream_is_the_one_on_its_register_connection() -> None:
    changes: list[str] = []
    link, token = registered_link(changes)
    assert link.kubelet_stream_open and link.stream_seen and changes == ["change"]
    state = link.debug_state()
    assert state["registered"] is True and state["stream_open_since"] == "2023-11-14T22:13:20.000+00:00"
    assert state["registered_since"] == state["stream_open_since"]
    other = link.stream_opened(OTHER)  # a debugging client: not the kubelet
    assert link.open_streams == 2 and changes == ["change"]
    link.stream_closed(token)  # the kubelet went
    assert not link.kubelet_stream_open and link.stream_seen and link.streams_ended == 1
    assert changes == ["change", "change"]
    assert link.debug_state()["registered"] is False and link.debug_state()["stream_open_since"] == ""
    link.stream_closed(other)
    link.stream_closed(other)  # twice: harmless
    assert changes == ["change", "change"] and link.open_streams == 0


def test_options_outside_register_do_not_make_a_kubelet() -> None:
    link = KubeletLink()
    link.options_requested(OTHER)  # our own self-check, before Register
    link.register_started()
    link.options_requested(KUBELET)
    link.register_finished(accepted=True)
    token = link.stream_opened(OTHER)
    assert not link.kubelet_stream_open
    link.stream_closed(token)
    link.stream_opened(KUBELET)
    assert link.kubelet_stream_open


def test_a_new_register_waits_for_its_own_stream() -> None:
    changes: list[str] = []
    link, token = registered_link(changes)
    link.stream_closed(token)
    link.register_started()
    assert not link.stream_seen and not link.accepted
    link.register_finished(accepted=False)
    # the kubelet opens a stream on a connection it used in an earlier Register of this run: its own
    link.stream_opened(KUBELET)
    assert link.kubelet_stream_open and link.stream_seen


def test_fallback_when_the_kubelet_never_asked_for_the_options() -> None:
    link = KubeletLink()
    link.register_started()
    link.register_finished(accepted=True)
    link.stream_opened(KUBELET)
    assert link.kubelet_stream_open  # the first stream after an accepted Register counts
    before_accept = KubeletLink()
    before_accept.stream_opened(OTHER)
    assert not before_accept.kubelet_stream_open


def test_remembered_connections_are_bounded() -> None:
    link = KubeletLink()
    for n in range(MAX_KUBELET_CONNECTIONS + 5):
        link.register_started()
        link.options_requested(f"connection-{n}")
        link.register_finished(accepted=False)
    assert len(link._kubelet_connections) == MAX_KUBELET_CONNECTIONS
    link.stream_opened("connection-0")  # forgotten: its kubelet is long gone
    assert not link.kubelet_stream_open
    link.stream_opened(f"connection-{MAX_KUBELET_CONNECTIONS + 4}")
    assert link.kubelet_stream_open
