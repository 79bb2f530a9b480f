"""The session: every generation of this window's life, each tagged with the settings it ran with."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from app.plot_data import PlotBuffers
from engine.files.trace import Run, make_header
from engine.methods.registry import spec_label


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


@dataclass(frozen=True)
class SavedCalibration:
    """A trace's calibration (engine.core.decoder.Calibration's fields), for its replay's TPOT prediction."""

    target_step_ms: float
    draft_step_ms: float

    @property
    def c(self) -> float:
        return self.draft_step_ms / self.target_step_ms if self.target_step_ms > 0 else 0.0


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
    origin: dict = field(default_factory=dict)  # target, draft, device, dtype, prompt_ids (header fields)
    replayed_from: Optional[str] = None  # the trace file it was read from
    kept: bool = False  # written to the kept session (app.autosave)
    # suffix decoding: the documents the session's memory held as it began, and the vocabulary, so that its
    # diagnosis replays it exactly (not kept in traces)
    suffix_replay: Optional[tuple] = None

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

    @property
    def finished_ok(self) -> bool:
        return self.finish in ("eos", "length")

    def header(self) -> dict:
        """This generation's trace header (engine.files.trace): prompt, settings, models, device, versions."""
        o, cal = self.origin, self.calibration
        header = make_header(self.prompt, self.config, o.get("target"), o.get("draft"), o.get("device"),
                             o.get("dtype"), self.index, o.get("prompt_ids"))
        if cal is not None:  # an extra key: the TPOT prediction of a replay uses the machine that ran it
            header["calibration"] = {"target_step_ms": cal.target_step_ms, "draft_step_ms": cal.draft_step_ms}
        if self.suffix_replay is not None:  # what suffix decoding's memory held: a reader may rebuild it
            from engine.methods.suffix.drafter import memory_fingerprint

            header["suffix_memory"] = memory_fingerprint(*self.suffix_replay)
        return header

    def replay(self):
        """K -> this generation's rounds replayed (engine.analysis.predict.Trace.replay), or None."""
        if self.suffix_replay is None or not self.origin.get("prompt_ids") or not self.finished_ok:
            return None
        from engine.methods.registry import node_budget
        from engine.methods.suffix.drafter import generations_replay

        documents, vocab = self.suffix_replay
        output = [t for e in self.events for t in e.emitted_ids]
        return generations_replay([(documents, self.origin["prompt_ids"], output)], node_budget(self.config),
                                  vocab)

    def to_run(self) -> Run:
        return Run(header=self.header(), events=list(self.events), finish=self.finish or "running")

    def settings_label(self) -> str:
        c = self.config
        k = "" if c.method == "none" else f" K={c.k}"
        return f"{method_label(c)}{k} · {sampling_label(c.sampling, c.seed)}"

    def summary(self) -> str:
        status = self.finish or "running…"
        replay = "  (replayed)" if self.replayed_from else ""
        text = f"#{self.index}  {self.settings_label()} · {self.tokens} tok · {status}{replay}"
        if self.events:
            m = self.events[-1].metrics
            alpha = f"α={m.acceptance_rate:.2f} · " if m.drafted and self.config.method != "none" else ""
            rates = f"{m.tokens_per_forward:.2f} tok/fwd · {m.tokens_per_s:.0f} tok/s"
            text += f"\n     {alpha}{rates} · {self.models}"
        return text


class Session:
    def __init__(self):
        self.generations: list = []

    def new(self, prompt: str, config, models: str, calibration, origin: Optional[dict] = None) -> Generation:
        gen = Generation(len(self.generations) + 1, prompt, config, models, calibration, origin=origin or {})
        self.generations.append(gen)
        return gen

    def add_run(self, run: Run, source: str, calibration=None) -> Generation:
        """A generation read back from a trace: every round added as if it had just arrived."""
        models = run.models
        origin = {"target": models.get("target"), "draft": models.get("draft"),
                  "device": run.header.get("device"), "dtype": run.header.get("dtype"),
                  "prompt_ids": run.header.get("prompt_ids")}
        label = " + ".join(str(m) for m in (models.get("target"), models.get("draft")) if m) or "from a trace"
        saved = run.header.get("calibration")
        if isinstance(saved, dict) and saved.get("target_step_ms"):
            calibration = SavedCalibration(float(saved["target_step_ms"]),
                                           float(saved.get("draft_step_ms", 0)))
        gen = self.new(run.prompt, run.config, label, calibration, origin)
        gen.replayed_from = source
        for event in run.events:
            gen.add(event)
        gen.finish = run.finish or "ended"
        gen.suffix_replay = self._suffix_memory_of(gen, run.header.get("suffix_memory"))
        return gen

    def _suffix_memory_of(self, gen: Generation, fingerprint) -> Optional[tuple]:
        """(documents, vocab) of a suffix generation read back from a trace, where its header's fingerprint of
        the session's memory is rebuilt by the History's earlier suffix generations on its target (the last
        ones, in order); None otherwise. Its diagnosis then replays every K exactly, as for a live run."""
        if gen.config.method != "suffix" or not isinstance(fingerprint, dict):
            return None
        from engine.methods.suffix.drafter import memory_from_generations

        earlier = self.suffix_generations(gen.origin.get("target"), self.generations[:gen.index - 1])
        documents = memory_from_generations(earlier, fingerprint)
        return None if documents is None else (documents, fingerprint["vocab"])

    def suffix_generations(self, target, generations: Optional[list] = None) -> list:
        """(prompt ids, output) of each suffix generation on `target` (of `generations`, default all), in
        order: what suffix decoding's memory holds of the session on that target."""
        return [(g.origin.get("prompt_ids"), [t for e in g.events for t in e.emitted_ids])
                for g in (self.generations if generations is None else generations)
                if g.config.method == "suffix" and g.origin.get("target") == target and g.events]

    def runs(self) -> list:
        """Every generation as an engine.files.trace.Run: what the exporters take."""
        return [g.to_run() for g in self.generations if g.events]

    def clear(self) -> None:
        self.generations = []

    def all_events(self) -> list:
        """(generation index, RoundEvent) pairs, in order: what the exporters take. The last round of a
        generation that was stopped or failed carries that finish reason ("stopped", "error")."""
        return [(g.index, e) for g in self.generations for e in g.finished_events()]
