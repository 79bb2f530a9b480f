"""Issue 54 in the window: while connected to a served engine, Find the fastest K, the method sweep, Check
lossless, the batch regime, Recalibrate costs, Open draft heads and the head doctor never run the local models
(one dialog saying what works while connected), and the inspector says "not given by the server" for what a
served round does not give."""
from __future__ import annotations

import pytest
from fake_llama_server import FakeServer
from test_app_server import connect, generate, window  # noqa: F401 (a fixture)

from app.round_view import NOT_GIVEN, describe, round_tokens

pytestmark = pytest.mark.usefixtures("isolated_qsettings")

TASKS = ["sweep_action", "method_sweep_action", "check_action", "batch_action", "recalibrate_action",
         "heads_action", "doctor_action"]


@pytest.mark.parametrize("task", TASKS)
def test_local_tasks_are_refused_in_a_dialog_while_connected(qtbot, window, monkeypatch, task):  # noqa: F811
    with FakeServer() as server:
        connect(qtbot, window, monkeypatch, server.url)
        window.method_actions["draft"].trigger()
        window.prompt.setPlainText("def f(x):")
        action = getattr(window, task, None) or getattr(window.menus, task)
        action.trigger()
        assert not window.running and window.load_job is None
    [(title, message)] = window.errors
    assert title == "Connected to a server"
    assert "llama.cpp http://127.0.0.1:" in message and "main.py bench server" in message
    assert "--check-equal" in message and "Back to the shipped pair" in message


def test_the_inspector_says_not_given_for_a_served_round(qtbot, window, monkeypatch):  # noqa: F811
    with FakeServer() as server:
        connect(qtbot, window, monkeypatch, server.url)
        generate(qtbot, window, 16)
    events = window.session.generations[-1].events
    infos = [info for event in events for info in round_tokens(event)]
    drafted = [info for info in infos if info.depth is not None]
    nexts = [info for info in infos if info.depth is None]
    assert drafted and nexts
    for info in drafted + nexts:
        text = describe(info)
        assert NOT_GIVEN in text and "—" not in text and "greedy:" not in text
    assert any("accepted (from the server's counters" in describe(info) for info in drafted)
