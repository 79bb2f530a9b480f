"""Training presets: the shipped recipe (`full`, one H200) and a CPU smoke test (`tiny`, < 1 minute).

Every number the recipe uses lives here so the model card can quote the preset verbatim.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

# the pipeline's stages in order (engine.train.stages runs them; the CLI parses names without importing it)
STAGES = ["tokenizer", "target", "draft", "distill", "medusa", "eagle", "export"]


@dataclass
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


@dataclass
class StageSchedule:
    """One optimisation run: steps, batch, learning rate and a wall-clock cap (the cosine follows
    whichever of steps or time runs out first, so a capped run still ends at a low learning rate)."""
    steps: int
    batch_size: int
    lr: float
    time_budget_s: float
    warmup_steps: int = 50
    eval_every: int = 200
    weight_decay: float = 0.1


@dataclass
class Preset:
    name: str
    vocab_size: int
    seq_len: int
    max_files: Optional[int]          # corpus subset (None = every file)
    max_file_bytes: int               # skip generated data tables and other giants
    target: ModelShape
    draft: ModelShape
    target_sched: StageSchedule
    draft_sched: StageSchedule
    distill_sched: StageSchedule
    medusa_sched: StageSchedule
    eagle_sched: StageSchedule
    medusa_heads: int = 4
    eagle_ce_weight: float = 0.1
    val_fraction: float = 0.05
    eval_windows: int = 64            # validation windows for every reported metric
    n_prompts: int = 32
    sample_bytes: int = 30_000
    seed: int = 1234
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> Preset:
    """The shipped family: target ~7.4M params (<15 MB fp16), draft ~1.9M params (<4 MB fp16)."""
    return Preset(
        name="full",
        vocab_size=8192,
        seq_len=1024,
        max_files=None,
        max_file_bytes=256_000,
        target=ModelShape(hidden_size=320, num_layers=5, num_heads=5, num_kv_heads=5, intermediate_size=576),
        draft=ModelShape(hidden_size=160, num_layers=2, num_heads=5, num_kv_heads=5, intermediate_size=448),
        target_sched=StageSchedule(steps=8000, batch_size=64, lr=3e-3, time_budget_s=190, warmup_steps=200),
        draft_sched=StageSchedule(steps=4000, batch_size=64, lr=4e-3, time_budget_s=60, warmup_steps=100),
        distill_sched=StageSchedule(steps=3000, batch_size=64, lr=1.5e-3, time_budget_s=70, warmup_steps=50),
        medusa_sched=StageSchedule(steps=2000, batch_size=48, lr=2e-3, time_budget_s=40, warmup_steps=50,
                                   weight_decay=0.0),
        eagle_sched=StageSchedule(steps=3000, batch_size=48, lr=2e-3, time_budget_s=60, warmup_steps=100,
                                  weight_decay=0.0),
    )


def tiny() -> Preset:
    """Every stage on a few files with toy dimensions: checks the plumbing, not the quality."""
    small = ModelShape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
    smaller = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)

    def sched(steps: int, lr: float) -> StageSchedule:
        return StageSchedule(steps=steps, batch_size=8, lr=lr, time_budget_s=6, warmup_steps=5,
                             eval_every=20, weight_decay=0.0)

    return Preset(
        name="tiny", vocab_size=512, seq_len=64, max_files=40, max_file_bytes=40_000,
        target=small, draft=smaller,
        target_sched=sched(40, 1e-2), draft_sched=sched(30, 1e-2), distill_sched=sched(15, 5e-3),
        medusa_sched=sched(15, 5e-3), eagle_sched=sched(15, 5e-3),
        eval_windows=8, n_prompts=8, sample_bytes=4_000,
    )


PRESETS = {"full": full, "tiny": tiny}
