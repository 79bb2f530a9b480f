"""Shared helpers of the window tests: a MainWindow on real model folders, dialogs answered by the test."""
from __future__ import annotations

from app.main_window import MainWindow


def catch_errors(window) -> None:
    """Dialogs go to window.errors [(title, message)] instead of message boxes."""
    window.errors = []
    window.show_error = lambda title, message: window.errors.append((title, message))


def open_real_window(qtbot, target, draft=None) -> MainWindow:
    """A shown window on the CPU that has loaded `target` (and `draft`) without an error."""
    window = MainWindow(device="cpu")
    catch_errors(window)
    qtbot.addWidget(window)
    window.show()
    window.start(str(target), None if draft is None else str(draft))
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)
    assert window.errors == [] and window.decoder is not None
    return window


def answer_save(window, path) -> None:
    """Every save dialog of the window answers `path`."""
    window.ask_save_path = lambda title, file_filter, name="": str(path)
