"""Small widgets of the main window: the prompt editor and a status-bar label that never shrinks."""
from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QPlainTextEdit


class PromptEdit(QPlainTextEdit):
    """The prompt editor: Ctrl+Enter generates, Esc stops."""

    submitted = Signal()
    stopRequested = Signal()

    def keyPressEvent(self, event) -> None:
        enter = event.key() in (Qt.Key_Return, Qt.Key_Enter)
        if enter and event.modifiers() & Qt.ControlModifier:
            self.submitted.emit()
        elif event.key() == Qt.Key_Escape:
            self.stopRequested.emit()
        else:
            super().keyPressEvent(event)


class SteadyLabel(QLabel):
    """A status-bar label whose width only grows: live text that changes every tick would otherwise
    relayout (and repaint) the status bar each time."""

    def __init__(self):
        super().__init__()
        self._widest = 0

    def sizeHint(self):
        hint = super().sizeHint()
        self._widest = max(self._widest, hint.width())
        hint.setWidth(self._widest)
        return hint

    def minimumSizeHint(self):
        return self.sizeHint()
