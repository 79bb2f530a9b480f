"""The one registry of decoding methods: name, label, chain or tree, needs, how its drafter is built.

CLI choices, GUI menus, availability reasons and the session's labels all come from here. A method with a tree
size is spelled `NAME:NODES` everywhere (`eagle:8`, `medusa:16`); the bare name means the method's default
shape.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from engine.errors import SpecplayError

MAX_TREE_NODES = 64
MEDUSA_FILES = ("medusa_heads.safetensors", "medusa_config.json")
EAGLE_FILES = ("eagle_head.safetensors", "eagle_config.json")
EAGLE3_FILES = ("eagle3_head.safetensors", "eagle3_config.json")
# an EAGLE-3 head of the published architecture in the target's folder: eagle3/ in the speculators layout (the
# shipped family's); it is the target's own head where the project's own files are absent
EAGLE3_PUBLISHED_FILES = ("eagle3/config.json", "eagle3/model.safetensors")


@dataclass(frozen=True)
class Method:
    name: str  # the engine's and the CLI's spelling
    label: str  # what menus and tables show
    shape: str  # "chain", "tree", or "chain|tree" (a chain by default, a tree with NAME:NODES)
    files: tuple = ()  # files in the target's folder it needs (heads)
    other_files: tuple = ()  # or these instead (another layout of the same heads)
    needs_draft_model: bool = False
    needs_tree_target: bool = False  # tree verification needs the Llama-family runner's tree mask
    needs_llama_target: bool = False  # drafts with the target's own layers (engine.models.llama.LlamaRunner)
    default_tree_nodes: Callable[[int], int] = staticmethod(lambda k: 0)  # nodes for K when no size is given
    sized_label: str = ""  # the label with a tree size, {nodes} in it ("": the label, "tree of N nodes")
    build: Optional[Callable] = None  # build(decoder, config) -> Drafter
    # batch_build(batch_decoder, config) -> engine.core.batch.BatchDrafter; None: not batched
    batch_build: Optional[Callable] = None

    @property
    def batched(self) -> bool:
        return self.batch_build is not None

    @property
    def takes_tree_size(self) -> bool:
        return "tree" in self.shape

    def tree_nodes_for(self, config) -> int:
        """The node budget a generation of this method uses (0 = a chain)."""
        return config.tree_nodes or self.default_tree_nodes(config.k)

    def is_tree(self, config) -> bool:
        return self.shape == "tree" or (self.shape == "chain|tree" and config.tree_nodes > 0)


def _none(decoder, config):
    from engine.methods.base import NoDrafter

    return NoDrafter()


def _draft(decoder, config):
    from engine.methods.draft_model.drafter import DraftModelDrafter

    return DraftModelDrafter(decoder.pair.draft, decoder.target)


def _ngram(decoder, config):
    from engine.methods.ngram.drafter import NgramDrafter

    return NgramDrafter(decoder.target,
                        decoder.ngram_table() if config.uses_ngram_table(decoder.device) else None)


def _medusa(decoder, config):
    from engine.methods.medusa.drafter import MedusaDrafter

    return MedusaDrafter(decoder.target, decoder.medusa_heads(), nodes=config.tree_nodes or None)


def _medusa_fixed(decoder, config):
    from engine.methods.medusa.drafter import FixedTreeMedusaDrafter

    return FixedTreeMedusaDrafter(decoder.target, decoder.medusa_heads(), nodes=config.tree_nodes or None)


def _eagle(decoder, config):
    from engine.methods.eagle.drafter import EagleDrafter

    return EagleDrafter(decoder.target, decoder.eagle_head(), tree_nodes=config.tree_nodes)


def _eagle3(decoder, config):
    from engine.methods.eagle3.drafter import Eagle3Drafter

    return Eagle3Drafter(decoder.target, decoder.eagle3_head(), tree_nodes=config.tree_nodes)


def _lookahead(decoder, config):
    from engine.methods.lookahead.drafter import LookaheadDrafter

    return LookaheadDrafter()


def _suffix(decoder, config):
    from engine.methods.suffix.drafter import SuffixDrafter

    memory = decoder.suffix_memory()
    if config.suffix_corpus:
        memory.load_corpus(config.suffix_corpus, decoder.tokenizer)
    return SuffixDrafter(memory, tree_nodes=METHODS["suffix"].tree_nodes_for(config))


def _layerskip(decoder, config):
    from engine.methods.layerskip.drafter import LayerSkipDrafter

    return LayerSkipDrafter(decoder.target, config.draft_layers)


def _none_batch(decoder, config):
    from engine.methods.batch_base import NoBatchDrafts

    return NoBatchDrafts()


def _draft_batch(decoder, config):
    from engine.methods.draft_model.batch import DraftModelBatchDrafter

    return decoder.kept_drafter("draft", lambda: DraftModelBatchDrafter(decoder.pair.draft))


def _ngram_batch(decoder, config):
    from engine.methods.ngram.batch import NgramBatchDrafter

    table = decoder.ngram_table() if config.uses_ngram_table(decoder.device) else None
    return NgramBatchDrafter(config.ngram_n, table)


def _eagle_batch(decoder, config):
    from engine.methods.eagle.batch import EagleBatchDrafter

    return decoder.kept_drafter("eagle", lambda: EagleBatchDrafter(decoder.eagle_head()))


METHODS = {m.name: m for m in (
    Method("none", "Off (plain autoregressive)", "chain", build=_none, batch_build=_none_batch),
    Method("draft", "Draft model", "chain", needs_draft_model=True, build=_draft, batch_build=_draft_batch),
    Method("ngram", "N-gram prompt lookup", "chain", build=_ngram, batch_build=_ngram_batch),
    Method("medusa", "Medusa", "tree", files=MEDUSA_FILES, needs_tree_target=True,
           default_tree_nodes=lambda k: 2 * k, build=_medusa),
    Method("medusa-fixed", "Medusa, fixed tree", "tree", files=MEDUSA_FILES, needs_tree_target=True,
           default_tree_nodes=lambda k: 2 * k, sized_label="Medusa, fixed tree of {nodes} nodes",
           build=_medusa_fixed),
    Method("eagle", "EAGLE", "chain|tree", files=EAGLE_FILES, needs_tree_target=True, build=_eagle,
           batch_build=_eagle_batch),  # batched: its chain
    Method("eagle3", "EAGLE-3", "chain|tree", files=EAGLE3_FILES, other_files=EAGLE3_PUBLISHED_FILES,
           needs_tree_target=True, needs_llama_target=True, build=_eagle3),
    Method("lookahead", "Lookahead", "tree", needs_tree_target=True, build=_lookahead),
    Method("suffix", "Suffix decoding", "tree", needs_tree_target=True,
           default_tree_nodes=lambda k: min(2 * k, MAX_TREE_NODES), build=_suffix),
    Method("layerskip", "Layer skip (self-speculation)", "chain", needs_llama_target=True, build=_layerskip),
)}
NAMES = tuple(METHODS)
# the methods batched decoding (engine.core.batch) runs, plain decoding first
BATCH_METHODS = tuple(name for name, m in METHODS.items() if m.batched)
# What the GUI's Method menu offers, in order: plain methods, and EAGLE's (and EAGLE-3's) dynamic tree at the
# default K's 2K nodes. The first nine have the shortcuts Ctrl+1 .. Ctrl+9.
MENU_SPECS = ("none", "draft", "ngram", "medusa", "eagle", "eagle:8", "eagle3", "eagle3:8", "lookahead",
              "suffix", "layerskip", "medusa-fixed")


def node_budget(config):
    """K -> the node budget a generation of config's method drafts with at K (0 = a chain)."""
    method = get(config.method)
    return lambda k: method.tree_nodes_for(replace(config, k=k))


def get(name: str) -> Method:
    method = METHODS.get(name)
    if method is None:
        raise SpecplayError(f"unknown method {name!r}; choose one of: {', '.join(NAMES)}")
    return method


@dataclass(frozen=True)
class MethodSpec:
    """What a user picks: a method and, for tree methods, a node budget (0 = the method's default)."""

    name: str
    tree_nodes: int = 0

    def __str__(self) -> str:
        return f"{self.name}:{self.tree_nodes}" if self.tree_nodes else self.name

    @property
    def method(self) -> Method:
        return get(self.name)

    @property
    def label(self) -> str:
        return spec_label(self.name, self.tree_nodes)


def parse_spec(spec: str) -> MethodSpec:
    """'eagle:8' -> MethodSpec('eagle', 8); 'draft' -> MethodSpec('draft', 0).

    Bad spellings raise SpecplayError."""
    name, colon, nodes = str(spec).strip().partition(":")
    method = get(name)
    if not colon:
        return MethodSpec(name)
    try:
        count = int(nodes)
    except ValueError:
        raise SpecplayError(f"bad method {spec!r}: use NAME or NAME:TREE_NODES (e.g. eagle:8)") from None
    if not method.takes_tree_size:
        raise SpecplayError(f"method {name!r} drafts a chain and takes no tree size ({spec!r})")
    if not 1 <= count <= MAX_TREE_NODES:
        raise SpecplayError(f"tree nodes must be between 1 and {MAX_TREE_NODES} (got {spec!r})")
    return MethodSpec(name, count)


def spec_label(name: str, tree_nodes: int = 0) -> str:
    """'EAGLE', 'EAGLE, dynamic tree of 8 nodes', 'Medusa, tree of 16 nodes', 'Medusa, fixed tree of 16
    nodes'."""
    method = METHODS.get(name)
    if method is None:
        return name
    if not tree_nodes:
        return method.label
    if method.sized_label:
        return method.sized_label.format(nodes=tree_nodes)
    kind = "dynamic tree" if method.shape == "chain|tree" else "tree"
    return f"{method.label}, {kind} of {tree_nodes} nodes"


def unavailable_reason(method: Method, has_draft_model: bool, supports_tree: bool,
                       target_dir: Optional[str], llama_target: Optional[bool] = None) -> Optional[str]:
    """None when the method can run on this pair, else why not (one line for a tooltip or an error).
    llama_target: the target runs on engine.models.llama.LlamaRunner (None: as supports_tree says, the one
    runner
    with trees being that one)."""
    if method.needs_draft_model and not has_draft_model:
        return "no draft model loaded"
    if method.needs_tree_target and not supports_tree:
        return "tree drafts need a Llama-family target"
    if method.needs_llama_target and not (supports_tree if llama_target is None else llama_target):
        return "drafting with the target's own layers needs a Llama-family target"
    folder = Path(str(target_dir)) if target_dir is not None else None
    missing = [name for name in method.files if folder is None or not (folder / name).exists()]
    if missing and method.other_files and all(folder is not None and (folder / name).exists()
                                              for name in method.other_files):
        return None
    if missing:
        heads = "Medusa heads" if method.files == MEDUSA_FILES else f"{method.label} head"
        also = f" or {method.other_files[0]}" if method.other_files else ""
        return f"the target has no {heads} ({missing[0]}{also})"
    return None


def runnable_menu_specs(availability: dict) -> tuple:
    """(the Method menu's specs that can run, {each other spec: why not}) for a decoder's method_availability,
    in MENU_SPECS' order; a method the availability does not list is left out."""
    runnable, left_out = [], {}
    for spec in MENU_SPECS:
        reason = availability.get(parse_spec(spec).name, "not offered by the engine")
        if reason is None:
            runnable.append(spec)
        else:
            left_out[spec] = reason
    return runnable, left_out


def availability(has_draft_model: bool, supports_tree: bool, target_dir: Optional[str],
                 llama_target: Optional[bool] = None) -> dict:
    """Method name -> None when available, else the reason it is not."""
    return {name: unavailable_reason(m, has_draft_model, supports_tree, target_dir, llama_target)
            for name, m in METHODS.items()}
