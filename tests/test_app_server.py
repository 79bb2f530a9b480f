"""Models → Connect to a server…: generations from a (fake) llama-server on loopback through the window's
usual job path, the status line naming what the server cannot give, and bad servers as one dialog."""
from __future__ import annotations

import socket

import pytest
from fake_llama_server import FakeServer, expected_text
from PySide6.QtCore import Qt

from app import server_dialog
from app.main_window import MainWindow

pytestmark = pytest.mark.usefixtures("isolated_qsettings")


@pytest.fixture
def window(qtbot):
    def no_models(target, draft, device):
        raise AssertionError("a served window loads no local models")

    window = MainWindow(loader=no_models, device="cpu")
    window.errors = []
    window.show_error = lambda title, message: window.errors.append((title, message))
    qtbot.addWidget(window)
    window.show()
    return window


def connect(qtbot, window, monkeypatch, url: str) -> None:
    monkeypatch.setattr(server_dialog.ServerDialog, "exec", lambda self: server_dialog.ServerDialog.Accepted)
    monkeypatch.setattr(server_dialog.ServerDialog, "choice", lambda self: (url, None))
    window.connect_to_server()
    qtbot.waitUntil(lambda: window.load_job is None, timeout=10000)


def generate(qtbot, window, tokens: int) -> None:
    window.max_tokens.setValue(tokens)
    window.prompt.setPlainText("def f(x):")
    qtbot.keyClick(window.prompt, Qt.Key_Return, Qt.ControlModifier)
    qtbot.waitUntil(lambda: not window.running, timeout=10000)


def test_generations_come_from_the_server(qtbot, window, monkeypatch):
    with FakeServer() as server:
        connect(qtbot, window, monkeypatch, server.url)
        assert window.served is not None and window.errors == []
        generate(qtbot, window, 16)
    gen = window.session.generations[-1]
    assert "".join(e.emitted_text for e in gen.events) == expected_text(16)
    assert all(e.served.startswith("llama.cpp http://127.0.0.1:") for e in gen.events)
    assert sum(e.accepted_count for e in gen.events) == server.state.accepted
    assert "not given by the server" in window.statusBar().currentMessage()
    assert window.errors == []


def test_an_unreachable_server_is_one_dialog(qtbot, window, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    connect(qtbot, window, monkeypatch, f"http://127.0.0.1:{port}")
    assert window.served is None
    assert len(window.errors) == 1 and "unreachable" in window.errors[0][1]


def test_a_stream_cut_off_keeps_its_rounds(qtbot, window, monkeypatch):
    with FakeServer("cut") as server:
        connect(qtbot, window, monkeypatch, server.url)
        generate(qtbot, window, 20)
    gen = window.session.generations[-1]
    assert gen.events and sum(len(e.emitted_ids) for e in gen.events) <= 10
    assert len(window.errors) == 1 and "cut off" in window.errors[0][1]
