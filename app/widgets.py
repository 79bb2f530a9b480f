"""Small widgets of the main window: the prompt editor, a status-bar label that never shrinks, and file
dialogs that cannot hang on special files."""
from __future__ import annotations

from PySide6.QtCore import QFileInfo, Qt, Signal
from PySide6.QtWidgets import QDialogButtonBox, QFileDialog, QFileIconProvider, QLabel, QPlainTextEdit


class PromptEdit(QPlainTextEdit):
    """The prompt editor: Ctrl+Enter generates, Esc stops (the window's shortcuts do the same anywhere)."""

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


class SafeIconProvider(QFileIconProvider):
    """File icons and types from names only. Qt's own provider sniffs file contents for the type column, and
    reading /proc/kmsg (or a FIFO) blocks the GUI thread forever."""

    def icon(self, info):
        if isinstance(info, QFileInfo):
            kind = QFileIconProvider.Folder if info.isDir() else QFileIconProvider.File
            return super().icon(kind)
        return super().icon(info)

    def type(self, info: QFileInfo) -> str:
        if info.isDir():
            return "Folder"
        if not info.isFile():
            return "Special file"
        return f"{info.suffix().upper()} file" if info.suffix() else "File"


def file_dialog(parent, title: str, mode, file_filter: str = "") -> QFileDialog:
    """Qt's own file dialog (the same on every platform) with a provider that never reads a file."""
    dialog = QFileDialog(parent, title, "", file_filter)
    dialog.setOption(QFileDialog.DontUseNativeDialog, True)
    dialog.setOption(QFileDialog.DontUseCustomDirectoryIcons, True)
    provider = SafeIconProvider()
    dialog.setIconProvider(provider)
    dialog.icon_provider = provider  # Qt does not own it: the dialog's Python side keeps it alive
    dialog.setFileMode(mode)
    return dialog


def ask_path(parent, title: str, mode, file_filter: str = "", save: bool = False, folder: str = "",
             name: str = ""):
    """Run a file dialog (opened in `folder`, proposing the file `name` where given); the chosen path, or
    None."""
    dialog = file_dialog(parent, title, mode, file_filter)
    dialog.setAcceptMode(QFileDialog.AcceptSave if save else QFileDialog.AcceptOpen)
    if folder:
        dialog.setDirectory(folder)
    if name:
        dialog.selectFile(name)
    if mode == QFileDialog.Directory:
        dialog.setOption(QFileDialog.ShowDirsOnly, True)
    if dialog.exec() and dialog.selectedFiles():
        return dialog.selectedFiles()[0]
    return None


def settle_clipboard() -> None:
    """Hand the clipboard's text to a mime-data object Qt owns alone. A copy from the round view puts a
    QMimeData made in Python on the clipboard; Qt deletes it in its exit handlers, after Python has
    finalized, and Shiboken's bookkeeping for it then crashes the process. Run while Python lives (at
    quit); the user's copied text stays on the clipboard."""
    from PySide6.QtGui import QGuiApplication

    if QGuiApplication.instance() is None:
        return
    clipboard = QGuiApplication.clipboard()
    clipboard.setText(clipboard.text())


def finish_form(dialog, form, note: str) -> None:
    """A form dialog's last rows: a wrapped note, then OK / Cancel wired to accept / reject."""
    label = QLabel(note)
    label.setWordWrap(True)
    form.addRow(label)
    buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
    buttons.accepted.connect(dialog.accept)
    buttons.rejected.connect(dialog.reject)
    form.addRow(buttons)
