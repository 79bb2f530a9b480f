"""The session: every generation of this window's life, each tagged with the settings it ran with."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from app.plot_data import PlotBuffers
from engine.methods import spec_label


def method_label(config) -> str:
    """A config's method as the registry names it: 'Draft model', 'EAGLE, dynamic tree of 8 nodes'."""
    return spec_label(config.method, config.tree_nodes)


def sampling_label(sampling, seed: int) -> str:
    if sampling.greedy:
        return "greedy"
    parts = [f"T={sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top-k={sampling.top_k}")
    if sampling.top_p < 1.0:
        parts.append(f"top-p={sampling.top_p:g}")
    parts.append(f"seed={seed}")
    return " ".join(parts)


@dataclass
class Generation:
    index: int  # 1-based, in session order
    prompt: str
    config: object  # GenerationConfig
    models: str
    calibration: object = None
    events: list = field(default_factory=list)
    finish: Optional[str] = None  # "eos" | "length" | "stopped" | "error" | None while running
    error: Optional[str] = None

    def __post_init__(self):
        self.buffers = PlotBuffers(self.calibration)

    def add(self, event) -> None:
        self.events.append(event)
        self.buffers.add(event)

    def finished_events(self) -> list:
        """The events, the last one marked with the generation's finish when it did not finish itself."""
        last = self.events[-1] if self.events else None
        if last is None or last.finish_reason or self.finish not in ("stopped", "error"):
            return list(self.events)
        return self.events[:-1] + [replace(last, finish_reason=self.finish)]

    @property
    def running(self) -> bool:
        return self.finish is None

    @property
    def tokens(self) -> int:
        return sum(len(e.emitted_ids) for e in self.events)

    def settings_label(self) -> str:
        c = self.config
        k = "" if c.method == "none" else f" K={c.k}"
        return f"{method_label(c)}{k} · {sampling_label(c.sampling, c.seed)}"

    def summary(self) -> str:
        status = self.finish or "running…"
        text = f"#{self.index}  {self.settings_label()} · {self.tokens} tok · {status}"
        if self.events:
            m = self.events[-1].metrics
            alpha = f"α={m.acceptance_rate:.2f} · " if m.drafted else ""
            rates = f"{m.tokens_per_forward:.2f} tok/fwd · {m.tokens_per_s:.0f} tok/s"
            text += f"\n     {alpha}{rates} · {self.models}"
        return text


class Session:
    def __init__(self):
        self.generations: list = []

    def new(self, prompt: str, config, models: str, calibration) -> Generation:
        gen = Generation(len(self.generations) + 1, prompt, config, models, calibration)
        self.generations.append(gen)
        return gen

    def clear(self) -> None:
        self.generations = []

    def all_events(self) -> list:
        """(generation index, RoundEvent) pairs, in order: what the exporters take. The last round of a
        generation that was stopped or failed carries that finish reason ("stopped", "error")."""
        return [(g.index, e) for g in self.generations for e in g.finished_events()]
