"""Training presets: the shipped recipe (`full`, one H200) and a CPU smoke test (`tiny`, < 1 minute).

Every number the recipe uses lives here so the model card can quote the preset verbatim.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

# the pipeline's stages in order (engine.train.stages runs them; the CLI parses names without importing it)
STAGES = ["tokenizer", "target", "draft", "distill", "selfgen", "medusa", "eagle", "eagle3", "export", "eval"]


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
class SelfGen:
    """The target's own text for the heads' self-distillation: continuations of random training windows
    (`prompt_len` tokens) up to the heads' window, a share greedy and the rest sampled; plus greedy held-out
    ones from validation windows (the Medusa tree and the EAGLE-3 figures are measured on those)."""
    sequences: int
    val_sequences: int
    prompt_len: int = 32
    batch_size: int = 256
    greedy_fraction: float = 0.5
    temperature: float = 0.8
    time_budget_s: float = 15.0


@dataclass
class MedusaGreedy:
    """The Medusa heads' own recipe: the target's greedy continuations of random training windows
    (`sequences` of `prompt_len` + `new_tokens`), its final-normed features computed once, and head d
    trained by cross-entropy to rank first the text's token t+1+d at every position t from the prompt's last
    token on: exactly what a greedy round drafting from t needs. The medusa schedule's batch counts positions
    here.
    The prompts are the `prompt_len` tokens before a line end of standard-library training files (as the
    family's held-out prompts end at a line end of standard-library files; see stages.medusa_prompts);
    `val_sequences` continuations of prompts from a tenth of those files are held out: the kept snapshot, the
    reported accuracies and the drafter's tree (path accuracies) come from them. No validation file is
    read."""
    sequences: int = 6144
    val_sequences: int = 256
    prompt_len: int = 64
    new_tokens: int = 128
    batch_size: int = 64              # sequences generated at once
    # passes over those training files drawing the held-out prompts' own form too: whole lines from a
    # top-level line, 100 to 300 characters (stages.top_level_prompts; the held-out continuations get a fifth
    # as many passes, at least one); 0: none
    top_level_rounds: int = 0
    top_level_limit: int = 0          # at most this many top-level prompts a split (0: every one drawn)


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
    eagle3_sched: Optional[StageSchedule] = None
    selfgen: Optional[SelfGen] = None
    corpus: str = "stdlib"            # "stdlib" or "stdlib+packages" (permissively licensed installed ones)
    max_package_bytes: Optional[int] = None   # per distribution (a deterministic subset beyond it)
    bpe_sample_bytes: Optional[int] = None    # the tokenizer learns from this much training text (None: all)
    head_seq_len: Optional[int] = None        # the heads' training windows (None: seq_len)
    gen_fraction: float = 0.5         # share of each head batch taken from the target's own text
    medusa_distill: bool = True       # Medusa heads learn the target's distributions (else corpus tokens)
    medusa_greedy: Optional[MedusaGreedy] = None   # set: the heads learn its greedy text instead (see there)
    eagle3_steps: int = 5             # training-time-test steps
    eagle3_decay: float = 0.8         # step s's loss weight is decay^(s-1), normalised
    eagle3_intermediate: int = 320    # the EAGLE-3 layer's MLP width (so that the family fits its cap)
    eagle3_taps: Optional[tuple] = None   # target layers fused (None: a low, a middle and the last)
    # "specplay": the project's own head (proj + fc over [feature ; embedding], the target's norm and LM
    # head); "published": the published EAGLE-3 architecture (engine/methods/eagle3/public.py), written in
    # the speculators layout
    eagle3_arch: str = "specplay"
    # published: the LM head keeps the rows of the N tokens most frequent in the training split (d2t / t2d
    # map them, engine/train/draft_vocab.py); 0 keeps the whole vocabulary
    eagle3_draft_vocab: int = 0
    eval_signatures: int = 200        # plausibility: held-out signatures ...
    eval_new_tokens: int = 96         # ... completed greedily by this many tokens
    eval_max_files: Optional[int] = None   # held-out stdlib files for the perplexity (None: all)
    medusa_heads: int = 4
    medusa_layers: int = 1            # residual blocks a Medusa head (1 or 2)
    medusa_int8: bool = False         # ship the heads' matrices as int8 with a scale a row
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
    """The shipped family: target ~7.4M params (<15 MB fp16), draft ~1.9M params (<4 MB fp16), trained on the
    standard library and permissively licensed installed packages within ~8 minutes on one H200 (corpus and
    evaluation included: see scripts/training/train_family_gpu.sh)."""
    return Preset(
        name="full",
        vocab_size=8192,
        seq_len=1024,
        max_files=None,
        max_file_bytes=256_000,
        target=ModelShape(hidden_size=320, num_layers=5, num_heads=5, num_kv_heads=5, intermediate_size=576),
        draft=ModelShape(hidden_size=160, num_layers=2, num_heads=5, num_kv_heads=5, intermediate_size=448),
        target_sched=StageSchedule(steps=8000, batch_size=64, lr=3e-3, time_budget_s=140, warmup_steps=200,
                                   eval_every=400),
        draft_sched=StageSchedule(steps=4000, batch_size=64, lr=4e-3, time_budget_s=22, warmup_steps=100,
                                  eval_every=400),
        distill_sched=StageSchedule(steps=3000, batch_size=64, lr=1.5e-3, time_budget_s=32, warmup_steps=50,
                                    eval_every=400),
        # batch: positions of the greedy text (medusa_greedy); the budget is a 2-core CPU's
        medusa_sched=StageSchedule(steps=3000, batch_size=512, lr=2e-3, time_budget_s=900, warmup_steps=50,
                                   eval_every=500, weight_decay=0.0),
        medusa_greedy=MedusaGreedy(sequences=12288, batch_size=256, top_level_rounds=40),
        medusa_layers=2, medusa_int8=True,
        eagle_sched=StageSchedule(steps=3000, batch_size=48, lr=2e-3, time_budget_s=22, warmup_steps=100,
                                  eval_every=500, weight_decay=0.0),
        eagle3_sched=StageSchedule(steps=4000, batch_size=32, lr=2e-3, time_budget_s=60, warmup_steps=100,
                                   eval_every=500, weight_decay=0.0),
        eagle3_arch="published", eagle3_draft_vocab=4096,  # the shipped head (98.3% of the training tokens)
        selfgen=SelfGen(sequences=2048, val_sequences=64, batch_size=1024, time_budget_s=40),
        corpus="stdlib+packages",
        max_package_bytes=16_000_000,
        bpe_sample_bytes=24_000_000,
        head_seq_len=512,
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
        medusa_sched=sched(15, 5e-3), eagle_sched=sched(15, 5e-3), eagle3_sched=sched(15, 5e-3),
        selfgen=SelfGen(sequences=16, val_sequences=8, prompt_len=8, batch_size=8, time_budget_s=5),
        medusa_greedy=MedusaGreedy(sequences=16, val_sequences=8, prompt_len=8, new_tokens=16, batch_size=8,
                                   top_level_rounds=1, top_level_limit=12),
        medusa_layers=2, medusa_int8=True,
        eagle3_steps=3, eagle3_intermediate=96,
        eval_windows=8, n_prompts=8, sample_bytes=4_000,
        eval_signatures=8, eval_new_tokens=16, eval_max_files=2,
    )


PRESETS = {"full": full, "tiny": tiny}
