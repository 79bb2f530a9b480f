"""Persistent settings (QSettings, INI format): models, method, K, sampling, view and window layout."""
from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QByteArray, QSettings

from engine.config import GenerationConfig, SamplingParams
from engine.errors import SpecplayError
from engine.methods import parse_spec

ORGANIZATION = "specplay"
APPLICATION = "specplay"

METHOD_KEY = "decode/method"  # a method spec of engine.methods: 'draft', 'eagle:8'
DEFAULTS = {
    "models/target": "",
    "models/draft": "",
    METHOD_KEY: "draft",
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
RENAMED_SPECS = {"eagle-tree": "eagle:8"}  # a stored method's old spelling -> the registry's


class AppSettings:
    """Typed access to QSettings with defaults. Tests redirect the INI path with QSettings.setPath."""

    def __init__(self, qsettings: Optional[QSettings] = None):
        self.q = qsettings or QSettings(QSettings.IniFormat, QSettings.UserScope, ORGANIZATION, APPLICATION)

    def get(self, key: str):
        default = DEFAULTS[key]
        value = self.q.value(key, default)
        try:
            value = _coerce(value, type(default))
        except (TypeError, ValueError):
            return default
        return self._method_spec(value) if key == METHOD_KEY else value

    def _method_spec(self, spec: str) -> str:
        """The stored method in the registry's spelling. An old spelling is rewritten in the file as it is
        read; one the registry does not know (a removed method, a hand edit) reads as the default."""
        if spec in RENAMED_SPECS:
            spec = RENAMED_SPECS[spec]
            self.set(METHOD_KEY, spec)
        try:
            return str(parse_spec(spec))
        except SpecplayError:
            return DEFAULTS[METHOD_KEY]

    def set(self, key: str, value) -> None:
        self.q.setValue(key, value)

    def optional_path(self, key: str) -> Optional[str]:
        return self.get(key) or None

    def sampling(self) -> SamplingParams:
        temperature = 0.0 if self.get("decode/greedy") else self.get("decode/temperature")
        return SamplingParams(temperature=temperature, top_k=self.get("decode/top_k"),
                              top_p=self.get("decode/top_p"))

    def config(self) -> GenerationConfig:
        """What the next generation runs: the stored method spec (tree size included), K and sampling."""
        get = self.get
        config = GenerationConfig(k=get("decode/k"), sampling=self.sampling(), seed=get("decode/seed"),
                                  max_new_tokens=get("decode/max_new_tokens"))
        return config.with_spec(get(METHOD_KEY))

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
