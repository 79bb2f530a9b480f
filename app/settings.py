"""Persistent settings (QSettings, INI format): models, method, K, sampling, view and window layout."""
from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QByteArray, QSettings

from engine.config import GenerationConfig, SamplingParams

ORGANIZATION = "specplay"
APPLICATION = "specplay"

DEFAULTS = {
    "models/target": "",
    "models/draft": "",
    "decode/method": "draft",
    "decode/k": 4,
    "decode/greedy": True,
    "decode/temperature": 0.8,
    "decode/top_k": 0,
    "decode/top_p": 1.0,
    "decode/seed": 0,
    "decode/max_new_tokens": 128,
    "view/plots": True,
    "view/theme": "system",  # system | light | dark
}


class AppSettings:
    """Typed access to QSettings with defaults. Tests redirect the INI path with QSettings.setPath."""

    def __init__(self, qsettings: Optional[QSettings] = None):
        self.q = qsettings or QSettings(QSettings.IniFormat, QSettings.UserScope, ORGANIZATION, APPLICATION)

    def get(self, key: str):
        default = DEFAULTS[key]
        value = self.q.value(key, default)
        try:
            return _coerce(value, type(default))
        except (TypeError, ValueError):
            return default

    def set(self, key: str, value) -> None:
        self.q.setValue(key, value)

    def optional_path(self, key: str) -> Optional[str]:
        return self.get(key) or None

    def sampling(self) -> SamplingParams:
        temperature = 0.0 if self.get("decode/greedy") else self.get("decode/temperature")
        return SamplingParams(temperature=temperature, top_k=self.get("decode/top_k"),
                              top_p=self.get("decode/top_p"))

    def config(self) -> GenerationConfig:
        from app.session import EAGLE_TREE, engine_method

        menu_method, k = self.get("decode/method"), self.get("decode/k")
        return GenerationConfig(method=engine_method(menu_method), k=k, sampling=self.sampling(),
                                seed=self.get("decode/seed"), max_new_tokens=self.get("decode/max_new_tokens"),
                                tree_nodes=2 * k if menu_method == EAGLE_TREE else 0)

    def layout(self) -> tuple:
        return self.q.value("window/geometry", QByteArray()), self.q.value("window/state", QByteArray())

    def save_layout(self, geometry: QByteArray, state: QByteArray) -> None:
        self.q.setValue("window/geometry", geometry)
        self.q.setValue("window/state", state)

    def reset(self) -> None:
        self.q.clear()
        self.q.sync()

    def sync(self) -> None:
        self.q.sync()


def _coerce(value, kind):
    if kind is bool:
        return value if isinstance(value, bool) else str(value).lower() in ("true", "1", "yes")
    return kind(value)
