"""Colours for the round view and the plots, in a light and a dark variant, and the application's theme."""
from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication


@dataclass(frozen=True)
class TokenColors:
    text: str
    prompt: str
    accepted_bg: str
    rejected_fg: str
    untested_fg: str
    correction_bg: str
    bonus_bg: str
    boundary: str
    plot_bg: str
    plot_fg: str
    measured: str
    running: str
    analytic: str
    per_position: str
    predicted: str


LIGHT = TokenColors(
    text="#1f2328", prompt="#6e7781", accepted_bg="#c6efce", rejected_fg="#cf222e", untested_fg="#e8a5aa",
    correction_bg="#ffd8a8", bonus_bg="#b6d4fe", boundary="#b0b7c0", plot_bg="#ffffff", plot_fg="#1f2328",
    measured="#8c959f", running="#0969da", analytic="#cf222e", per_position="#8250df", predicted="#1a7f37",
)

DARK = TokenColors(
    text="#e6edf3", prompt="#8b949e", accepted_bg="#1f5130", rejected_fg="#ff7b72", untested_fg="#8e4b47",
    correction_bg="#7a4a10", bonus_bg="#1d4477", boundary="#57606a", plot_bg="#161b22", plot_fg="#e6edf3",
    measured="#6e7681", running="#58a6ff", analytic="#ff7b72", per_position="#d2a8ff", predicted="#56d364",
)


def system_is_dark() -> bool:
    """True when the application palette (which follows the system scheme) is dark."""
    app = QGuiApplication.instance()
    if app is None:
        return False
    scheme = app.styleHints().colorScheme()
    if scheme != Qt.ColorScheme.Unknown:
        return scheme == Qt.ColorScheme.Dark
    return app.palette().color(QPalette.Window).lightness() < 128


def colors_for(dark: bool) -> TokenColors:
    return DARK if dark else LIGHT


def dark_palette() -> QPalette:
    """A dark palette for platforms whose theme ignores a requested dark scheme."""
    pal = QPalette()
    roles = {
        QPalette.Window: "#1e1f22", QPalette.WindowText: "#e6edf3", QPalette.Base: "#161b22",
        QPalette.AlternateBase: "#1e1f22", QPalette.Text: "#e6edf3", QPalette.Button: "#2b2d31",
        QPalette.ButtonText: "#e6edf3", QPalette.Highlight: "#2f81f7", QPalette.HighlightedText: "#ffffff",
        QPalette.ToolTipBase: "#2b2d31", QPalette.ToolTipText: "#e6edf3", QPalette.PlaceholderText: "#8b949e",
    }
    for role, color in roles.items():
        pal.setColor(role, QColor(color))
    for role in (QPalette.WindowText, QPalette.Text, QPalette.ButtonText):
        pal.setColor(QPalette.Disabled, role, QColor("#6e7681"))
    return pal


SCHEMES = {"light": Qt.ColorScheme.Light, "dark": Qt.ColorScheme.Dark, "system": Qt.ColorScheme.Unknown}


def apply_theme(theme: str, request_scheme: bool, forced: bool) -> tuple:
    """Make the application 'light', 'dark' or follow the 'system'. With `request_scheme`, ask the platform
    for the theme's colour scheme; where the platform ignores it, force a palette instead. `forced` says
    whether a palette is forced now (it is dropped first). Returns (dark, forced)."""
    app = QApplication.instance()
    if forced:
        app.setPalette(QPalette())  # back to the platform's palette
    if request_scheme:
        app.styleHints().setColorScheme(SCHEMES[theme])
    dark = system_is_dark() if theme == "system" else theme == "dark"
    forced = dark != (app.palette().color(QPalette.Window).lightness() < 128)
    if forced:
        app.setPalette(dark_palette() if dark else app.style().standardPalette())
    return dark, forced
