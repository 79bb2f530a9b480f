"""Models → Connect to a server…: the next generations come from an OpenAI-compatible server (llama.cpp's
llama-server, vLLM, SGLang) through the window's usual job / worker path (engine.sources.server.ServedDecoder
takes the local decoder's place). Connecting (kind detection) runs off the GUI thread in ConnectWorker; a
server that cannot be reached or is not OpenAI-compatible is one dialog."""
from __future__ import annotations

from typing import Optional

from PySide6.QtWidgets import QComboBox, QDialog, QFormLayout, QLineEdit

from app.widgets import finish_form
from app.workers import Worker
from engine.sources.server import KINDS, ServedDecoder, ServedEngine

DETECT = "detect"
DEFAULT_URL = "http://127.0.0.1:8080"
NOT_GIVEN = ("per token p, q, min(1, p/q), u, the target's alternatives and the draft / verify split of a "
             "round's time are not given by the server")


class ServerDialog(QDialog):
    """The server's URL and kind (detected where the server says, by default)."""

    def __init__(self, parent=None, url: str = DEFAULT_URL):
        super().__init__(parent)
        self.setWindowTitle("Connect to a server")
        form = QFormLayout(self)
        self.url = QLineEdit(url)
        self.url.setPlaceholderText(DEFAULT_URL)
        self.kind = QComboBox()
        self.kind.addItems((DETECT,) + KINDS)
        form.addRow("OpenAI-compatible server URL", self.url)
        form.addRow("Engine", self.kind)
        finish_form(self, form,
                    "Generations go to its /v1/completions stream until you go back to the shipped pair. The "
                    f"server's own speculative counters give α and the rounds; {NOT_GIVEN}.")

    def choice(self) -> tuple:
        """(url, kind or None to detect)."""
        kind = self.kind.currentText()
        return self.url.text().strip(), None if kind == DETECT else kind


class ConnectWorker(Worker):
    """Connects (kind detection, a metrics check for engines that publish them) and posts
    ("connected", ServedDecoder)."""

    def __init__(self, url: str, kind: Optional[str]):
        super().__init__()
        self.url, self.kind = url, kind

    def work(self) -> None:
        engine = ServedEngine.connect(self.url, self.kind, read_timeout_s=30.0)
        engine.scrape()  # a llama.cpp started without --metrics or a broken endpoint says so now
        self.post("connected", ServedDecoder(engine))


def served_note(decoder: ServedDecoder) -> str:
    """The status line while generations come from a server."""
    return f"Generating on {decoder.device_name}: {NOT_GIVEN}."


def served_refusal(what: str, label: str) -> str:
    """Why `what` (a sweep, a check, the batch regime) does not run while the window is connected to a server:
    it would measure the local models, not the server. What works instead."""
    return (f"{what} runs the local models, and the window is connected to {label}: it would not measure the "
            "server. While connected, generations (Ctrl+Enter), Run N times, History, Compare, the plots and "
            "the exports work on the server's rounds. To tune the server itself: main.py bench server "
            "--server URL: speculation on and off, --k-sweep K,K,... where it takes K per request, "
            "--clients N,N,... (concurrent requests: its batch regime) and --check-equal (greedy text with "
            "speculation on equals off). Models → Back to the shipped pair disconnects.")
