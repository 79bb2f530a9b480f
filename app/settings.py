"""Persistent settings (QSettings, INI format): models, method, K, sampling, view and window layout."""
from __future__ import annotations

import math
import os
from typing import Optional

from PySide6.QtCore import QByteArray, QSettings

from engine.config import MAX_K, MAX_TEMPERATURE, MIN_TEMPERATURE, GenerationConfig, SamplingParams
from engine.errors import SpecplayError
from engine.methods.registry import parse_spec

ORGANIZATION = "specplay"
APPLICATION = "specplay"

METHOD_KEY = "decode/method"  # a method spec of engine.methods.registry: 'draft', 'eagle:8'
EXPORT_FOLDER_KEY = "view/export_folder"
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
    EXPORT_FOLDER_KEY: "",  # where the last export went: the next save dialog opens there
}
RENAMED_SPECS = {"eagle-tree": "eagle:8"}  # a stored method's old spelling -> the registry's
VALID = {  # key -> does a value of the default's type fit the widgets that show it?
    "decode/k": lambda v: 1 <= v <= MAX_K,
    "decode/temperature": lambda v: math.isfinite(v) and MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
    "decode/top_k": lambda v: 0 <= v <= 100_000,  # the sampling dialog's range
    "decode/top_p": lambda v: 0.0 < v <= 1.0,
    "decode/seed": lambda v: 0 <= v <= 2**31 - 1,
    "decode/max_new_tokens": lambda v: 1 <= v <= 8192,  # the window's spin box
    "view/theme": lambda v: v in ("system", "light", "dark"),
}
LAYOUT_KEYS = ("window/geometry", "window/state")
BOOL_TEXT = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class AppSettings:
    """Typed access to QSettings with defaults. Tests redirect the INI path with QSettings.setPath."""

    def __init__(self, qsettings: Optional[QSettings] = None):
        self.q = qsettings or QSettings(QSettings.IniFormat, QSettings.UserScope, ORGANIZATION, APPLICATION)
        self.notice: Optional[str] = self.repair()  # what was reset, for the window to say once

    def get(self, key: str):
        default = DEFAULTS[key]
        try:
            value = _coerce(self.q.value(key, default), type(default))
        except (TypeError, ValueError, OverflowError):
            return default
        if not VALID.get(key, lambda v: True)(value):
            return default
        return self._method_spec(value) if key == METHOD_KEY else value

    def repair(self) -> Optional[str]:
        """Reset what a corrupt or hand-edited file holds that the window cannot use: a file that does not
        parse (or holds garbled keys) entirely, else each unusable value. Returns a message, None if clean."""
        where = self.q.fileName()
        if self.q.status() != QSettings.NoError or _garbled(self.q):
            self.reset()
            return f"The settings file {where} was unreadable and has been reset to the defaults."
        keys = list(DEFAULTS) + list(LAYOUT_KEYS)
        bad = [key for key in keys if self.q.contains(key) and not self._usable(key)]
        for key in bad:
            self.q.remove(key)
        if not bad:
            return None
        self.q.sync()
        return f"Unusable values in the settings file {where} were reset to the defaults: {', '.join(bad)}."

    def _usable(self, key: str) -> bool:
        value = self.q.value(key)
        if key in LAYOUT_KEYS:
            return isinstance(value, QByteArray)
        default = DEFAULTS[key]
        try:
            value = _coerce(value, type(default))
        except (TypeError, ValueError, OverflowError):
            return False
        return VALID.get(key, lambda v: True)(value)

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

    def session_path(self):
        """The folder where the window keeps its session between runs (app.autosave): beside the settings
        file."""
        from pathlib import Path

        from app.autosave import SESSION_DIR

        return Path(self.q.fileName()).with_name(SESSION_DIR)

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
    """A stored value as the default's type; ValueError/TypeError when it is not one."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if not isinstance(value, (str, int)) or str(value).lower() not in BOOL_TEXT:
            raise ValueError(f"not a boolean: {value!r}")
        return BOOL_TEXT[str(value).lower()]
    if kind is str:
        if not isinstance(value, str):
            raise TypeError(f"not text: {value!r}")
        return value
    if isinstance(value, (list, dict, QByteArray)):
        raise TypeError(f"not a number: {value!r}")
    return kind(value)


def _garbled(q: QSettings) -> bool:
    """Keys no version could have written (not printable ASCII), or a non-empty file without one key."""
    keys = q.allKeys()
    if any(not (key.isascii() and key.isprintable()) for key in keys):
        return True
    try:
        return not keys and os.path.getsize(q.fileName()) > 0
    except OSError:
        return False
