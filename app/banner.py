"""A notice that stays: what the app changed on its own (a draft it could not keep, a method it switched),
shown above the text until the user dismisses it. A status message would vanish before it is read."""
from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton


class Banner(QFrame):
    """Hidden until notify(); every notice since the last dismissal stays listed; Dismiss clears them."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("notice")
        self.setFrameShape(QFrame.StyledPanel)
        self.setStyleSheet("#notice { background: #fff4ce; border: 1px solid #d4a72c; }"
                           "#notice QLabel { color: #3b2300; }")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.dismiss_button = QPushButton("Dismiss")
        self.dismiss_button.clicked.connect(self.dismiss)
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 8, 4)
        row.addWidget(self.label, 1)
        row.addWidget(self.dismiss_button)
        self.notices: list = []
        self.hide()

    def notify(self, text: str) -> None:
        self.notices.append(text)
        self.label.setText("<br>".join(f"⚠ {line}" for line in self.notices))
        self.show()

    def dismiss(self) -> None:
        self.notices = []
        self.label.clear()
        self.hide()
