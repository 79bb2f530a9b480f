"""Headless command line: run, check-lossless, bench, train. Bad input -> one line on stderr, exit 2.

The `gui` command is parsed here but launched by the caller (main.py passes `gui=`): the engine never imports
the app."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import warnings
from dataclasses import asdict, replace
from typing import Callable, Optional

from engine.bench import suite as bench
from engine.cli import batch as batch_cli
from engine.cli import server as server_cli
from engine.config import MAX_K, GenerationConfig, SamplingParams, check_int
from engine.core.metrics import final_metrics
from engine.core.synthetic import synthetic_note
from engine.core.threads import apply_threads, check_threads
from engine.errors import SpecplayError
from engine.files import bounded
from engine.files.exports import FORMATS, StreamingExport
from engine.methods import registry as methods
from engine.methods.registry import MethodSpec

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
MAX_PROMPT_BYTES = 16 * 1024 * 1024
MAX_COSTS_BYTES = 4 * 1024 * 1024
MAX_SAMPLES = 1_000_000
MAX_BENCH_COUNT = 10_000
BENCH_KS = bench.DEFAULT_KS
MAX_CHATTER_CHARS = 300
# engine.models.synthetic.SHAPES's names, for the help (that module imports torch; a test keeps them in step)
SYNTHETIC_SHAPES = ("tiny", "llama-1b", "llama-3b", "llama-7b", "llama-8b", "qwen3-tiny", "qwen3-1.7b",
                    "qwen3-4b", "qwen3-8b")


class Chatter(logging.Handler):
    """Warnings third-party code (transformers' logging, Python warnings) gives during a command. They are
    held back, so that a failure ends in one line with them folded in; after a success they are replayed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self._hf = None
        self.reset()

    def reset(self, caught: Optional[list] = None) -> None:
        self.logged: list = []
        self.caught = caught if caught is not None else []  # warnings.catch_warnings(record=True)'s list
        self.folded_in = False  # True once a failure's line has carried them

    @property
    def lines(self) -> list:
        return self.logged + [str(w.message) for w in self.caught]

    def emit(self, record) -> None:
        self.logged.append(record.getMessage())

    def hold_transformers(self) -> None:
        """Route transformers' logging here instead of stderr (called once transformers is imported)."""
        if self._hf is not None:
            return
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            return
        self._hf = hf_logging
        hf_logging.disable_default_handler()
        hf_logging.add_handler(self)

    def stop_holding(self) -> None:
        if self._hf is not None:
            self._hf.remove_handler(self)
            self._hf.enable_default_handler()
            self._hf = None

    def folded(self) -> str:
        """The held warnings as one short clause ('' when there were none)."""
        text = one_line(" ".join(line for line in self.lines if line.strip()))
        if not text:
            return ""
        self.folded_in = True
        cut = text if len(text) <= MAX_CHATTER_CHARS else text[:MAX_CHATTER_CHARS - 1] + "…"
        return f" (reported on the way: {cut})"

    def replay(self) -> None:
        for line in self.lines:
            _say(line)


CHATTER = Chatter()
METHOD_HELP = (f"{' | '.join(methods.NAMES)}; NAME:NODES for a tree of NODES nodes "
               f"(e.g. eagle:8, medusa:16)")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each option's default (none shown for options without one)."""

    def _get_help_string(self, action):
        text = action.help or ""
        silent = action.default in (None, False, argparse.SUPPRESS)
        if "%(default)" in text or silent or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) and exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise SpecplayError(message)


def shows_progress() -> bool:
    """Progress lines go to a terminal (or anywhere with SPECPLAY_PROGRESS=1); piped stderr stays one line
    per error."""
    return sys.stderr.isatty() or os.environ.get("SPECPLAY_PROGRESS") == "1"


def progress(message: str) -> None:
    """A long step's progress: one line on stderr, so stdout stays the generated text (or JSON)."""
    if shows_progress():
        print(message, file=sys.stderr, flush=True)


class SeedProgress:
    """'seeds done of N' on stderr: rewritten in place on a terminal, else a line every 10 %."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if not shows_progress():
            return
        if self.tty:
            end = "\n" if done == total else "\r"
            print(f"{self.label}: {done} of {total} seeds", end=end, file=sys.stderr, flush=True)
        elif tenth != self.shown:
            self.shown = tenth
            progress(f"{self.label}: {done} of {total} seeds")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: a local Hugging Face directory or a cached Hub id "
                                    "(default: the shipped pair in assets/models)")
    p.add_argument("--draft", help="draft model (same forms as --target)")
    p.add_argument("--heads", metavar="DIR_OR_ID",
                   help="published draft heads (EAGLE-1/2, EAGLE-3, Medusa; a local directory or a cached "
                        "Hub id): --method eagle, eagle3 or medusa then drafts with them instead of the "
                        "target's own")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: a CUDA GPU when there is one)")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the GPU forwards eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks for a Llama-family target (gloo on CPU, NCCL on cuda:0..N-1)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for small models, else physical cores - 1; "
                        "OMP_NUM_THREADS is respected)")


def _add_generation_args(p: argparse.ArgumentParser, prompt_required: bool = True) -> None:
    prompt = p.add_mutually_exclusive_group(required=prompt_required)
    default_note = "" if prompt_required else " (default: built-in prompts)"
    prompt.add_argument("--prompt", help="the prompt text" + default_note)
    prompt.add_argument("--prompt-file", help="read the prompt from this UTF-8 file (- reads stdin)")
    p.add_argument("--method", default="draft", help=METHOD_HELP)
    p.add_argument("--k", type=int, default=4, help=f"tokens drafted per round (1..{MAX_K})")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of "
                                                            "tokens with this much probability; 1 = off")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 = off")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling and acceptance tests")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="the tree size, as --method NAME:NODES gives it (medusa: node budget, default 2K; "
                        "eagle: 0 = a chain of K, N = a dynamic tree of N nodes)")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="layerskip: how many of the target's first layers draft (default: half of them)")
    p.add_argument("--suffix-corpus", default="",
                   help="suffix: a text file indexed beside the session's earlier prompts and outputs")
    p.add_argument("--ngram-corpus", default="auto", choices=("auto", "on", "off"),
                   help="ngram: whether the target's corpus table, where it ships one, fills the slots "
                        "prompt lookup leaves (auto: on the GPU, where a round costs the same whatever it "
                        "drafts; off on the CPU, where each drafted row costs)")
    p.add_argument("--synthetic-acceptance", default="", metavar="L | p1,p2,...",
                   help="TIMING STUDY, the text is not model output: verification runs as usual but "
                        "accepts as this profile says, with a seeded generator: L = a mean acceptance length "
                        "(the target's token included, 1..K+1; one rate at every position), or per-position "
                        "rates in [0, 1] (at most K, the last repeated; one rate alone is written 0.8,)")
    _add_model_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="main.py", description="specplay: a playground for speculative decoding")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    gui = sub.add_parser("gui", help="open the desktop playground (the default)")
    _add_model_args(gui)
    gui.add_argument("--open-trace", metavar="FILE",
                     help="replay a saved JSONL trace (Session → Export trace JSONL, or run --trace) "
                          "in the window")

    run = sub.add_parser("run", help="generate once and print the text and a summary")
    _add_generation_args(run, prompt_required=False)
    batch_cli.add_run_options(run)
    run.add_argument("--csv", help="write one row per round to this CSV file")
    run.add_argument("--trace", help="write the full RoundEvents to this JSONL file")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    server_cli.add_server_options(run)

    check = sub.add_parser("check-lossless", help="prove speculation does not change the output")
    _add_generation_args(check, prompt_required=False)
    check.add_argument("--samples", type=int, default=2000,
                       help="seeds for the chi-squared test of the first two sampled tokens")
    check.add_argument("--sample-temperature", type=float, default=0.8,
                       help="temperature of the sampled (chi-squared) part")
    check.add_argument("--sample-top-p", type=float, default=0.9, help="top-p of the sampled part")

    bench = sub.add_parser("bench", help="measured benchmarks (ratios side by side in one run)",
                           description=BENCH_DESCRIPTION)
    bench.add_argument("what", choices=tuple(BENCHMARKS), help="the benchmark (see above)")
    _add_generation_args(bench, prompt_required=False)
    bench.add_argument("--ks", default=None,
                       help=f"k-sweep: the K values to measure (default {BENCH_KS}; batch: the same); "
                            "runtimes: run every method at each of these K (default: --k alone)")
    bench.add_argument("--ls", default="", help="layerskip: draft layer counts L (default: 1 .. layers-1)")
    bench.add_argument("--methods", default="none,draft,ngram",
                       help=f"methods, graphs: comma-separated method specs ({METHOD_HELP}), or all: every "
                            "method of the GUI's Method menu that the pair can run")
    bench.add_argument("--prompts", type=int, default=4,
                       help="methods, k-sweep, graphs: held-out prompts to average over (without --prompt)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="methods, k-sweep, graphs: passes over the prompts")
    bench.add_argument("--passes", type=int, default=2,
                       help="k-sweep: sweeps at most, swept again while the machine's speed moved during the "
                            "last one (the steadiest is shown)")
    bench.add_argument("--hf", default="hf-eager,hf-assisted,hf-lookup",
                       help="runtimes: transformers generate variants beside specplay's methods "
                            "(hf-eager, hf-assisted, hf-lookup, hf-compile; 'none' for none)")
    bench.add_argument("--synthetic", default=None,
                       help="runtimes, methods, k-sweep, layerskip, graphs, batch: a random-weight pair of a "
                            "real shape instead of --target/--draft, timing only "
                            f"({', '.join(SYNTHETIC_SHAPES)}); the draft model is the target's first "
                            "layers; eagle, eagle3 and medusa run random-weight heads of the published "
                            "layouts (EAGLE-1/2; EAGLE-3 with a 32,000-token draft vocabulary; Medusa-1, 5 "
                            "heads each with its own LM head), not in batch yet")
    bench.add_argument("--json", action="store_true", help="runtimes: print one JSON object")
    batch_cli.add_bench_options(bench)
    server_cli.add_server_options(bench, bench=True)

    export_heads = sub.add_parser(
        "export-heads", help="write the target's (or given) draft heads in a public layout (speculators, "
                             "specforge, eagle, medusa)")
    export_heads.add_argument(
        "--format", required=True, choices=("speculators", "specforge", "eagle", "medusa"),
        help="speculators / specforge: an EAGLE-3 head of the published architecture; medusa: the target's "
             "Medusa heads in the Medusa-1 layout; eagle: refused (the project's EAGLE head is not the "
             "SafeAILab one)")
    export_heads.add_argument("out", metavar="OUT", help="a new or empty folder")
    export_heads.add_argument("--target",
                              help="the target whose heads are written (default: the shipped one)")
    export_heads.add_argument(
        "--heads", metavar="DIR_OR_ID",
        help="speculators / specforge: the EAGLE-3 head to rewrite (default: the target's own published-"
             "architecture head, its eagle3/ folder)")
    export_heads.add_argument(
        "--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
        help="medusa: the weights' dtype (default float32: the same values as the dequantised heads)")

    heads = sub.add_parser("heads", help="describe published draft heads (layout, the target they were "
                                         "trained for, tapped layers, draft vocabulary) and check them "
                                         "against the target")
    heads.add_argument("heads_dir", metavar="DIR_OR_ID", help="the heads' folder or a cached Hub id")
    _add_model_args(heads)

    doctor = sub.add_parser("doctor", help="why a draft head accepts less than expected: acceptance by draft "
                                          "position under each tap convention and norm option an EAGLE-3 "
                                          "config leaves open, the draft vocabulary's coverage, findings")
    _add_model_args(doctor)
    doctor.add_argument("--method", default=None, choices=("eagle", "eagle3", "medusa"),
                        help="the heads to examine (default: the method of --heads, else eagle3)")
    doctor.add_argument("--k", type=int, default=4, help="draft length (default 4)")
    doctor.add_argument("--prompts", type=int, default=4, help="held-out prompts to run (default 4)")
    doctor.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default 48)")

    _add_prediction_parsers(sub)
    try:
        from engine.train.cli import add_train_parser
    except ImportError:
        pass
    else:
        add_train_parser(sub)
    return parser


BENCHMARKS = {
    "methods": "each method of --methods against plain decoding on the same prompts (speedup = tokens/s "
               "over none's), beside its own c and the textbook E/(1+cK) and the share of it reached; "
               "options: --methods, --prompts, --repeats, the generation options",
    "k-sweep": "the measured speedup of each K of --ks beside the analytic E/(1+cK); options: --ks, "
               "--prompts, --repeats, --passes, --method, the generation options",
    "graphs": "each method run eagerly and with captured CUDA graphs (GPU only); options: --methods, "
              "--prompts, --repeats",
    "kernels": "the CuPy verification and sampling kernels against the torch reference (GPU only); "
               "no options",
    "runtimes": "specplay's methods and HF transformers generate end to end, time to first token apart, "
                "beside the measured weight-read floor; options: --methods, --hf, --synthetic, --json",
    "layerskip": "layer skip with each draft depth L of --ls against plain decoding, with the measured c "
                 "of L layers; options: --ls, --k, --prompts",
    "batch": "plain and speculative tokens/s at each batch size of --batches, the step-time roofline, the "
             "crossover batch and the best K per batch; options: --batches, --method, --k, --synthetic, "
             "--json",
    "server": "a served engine (--server URL): speculation on and off, --k-sweep, --clients (concurrent "
              "requests), --check-equal; options: --plain-server, --server-kind, the generation options",
}
BENCH_DESCRIPTION = "benchmarks:\n" + "\n".join(f"  {name:8} {text}" for name, text in BENCHMARKS.items())
ALPHA_DEFINITION = ("α = accepted drafted tokens / drafted tokens, over the rounds that drafted; a round "
                    "that drafted nothing (an n-gram miss) is left out of α but counts in tokens/forward")


def _add_prediction_parsers(sub) -> None:
    """`predict` and `diagnose`: read a `run --trace` JSONL; the cost model is calibrated on the models
    (--target/--draft), read from --costs, or taken from the trace alone (--no-calibrate)."""
    predict = sub.add_parser("predict", help="predict tokens/forward, speedup and the best K for other K "
                                             "from one recorded trace")
    diagnose = sub.add_parser("diagnose", help="why is it slow? phase bars and findings for a recorded trace")
    for p in (predict, diagnose):
        p.add_argument("--trace", required=True, help="a JSONL trace written by `main.py run --trace`")
        p.add_argument("--ks", default="1,2,3,4,5,6,7,8,10,12,16", help="K values to predict")
        p.add_argument("--costs", help="a cost model saved with --save-costs (skips calibration)")
        p.add_argument("--save-costs", help="write the calibrated cost model to this JSON file")
        p.add_argument("--no-calibrate", action="store_true",
                       help="use the trace's phase times alone (no model loading; a flat verification curve)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        _add_model_args(p)


def method_from_args(args) -> MethodSpec:
    """--method's spec; --tree-nodes sizes it when the spec does not (both sizes, differing: an error)."""
    spec = methods.parse_spec(args.method)
    nodes = args.tree_nodes
    if nodes is None or nodes == spec.tree_nodes:
        return spec
    if spec.tree_nodes:
        raise SpecplayError(f"--method {args.method} and --tree-nodes {nodes} give two tree sizes: give one")
    return MethodSpec(spec.name, nodes)


def config_from_args(args) -> GenerationConfig:
    spec = method_from_args(args)
    config = GenerationConfig(method=spec.name, k=args.k,
                              sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
                              seed=args.seed, max_new_tokens=args.max_new_tokens, tree_nodes=spec.tree_nodes,
                              draft_layers=args.draft_layers, suffix_corpus=args.suffix_corpus,
                              ngram_corpus=_on_off_auto(getattr(args, "ngram_corpus", "auto")),
                              synthetic_acceptance=_synthetic_text(getattr(args, "synthetic_acceptance", "")))
    config.validate()
    return config


def _synthetic_text(text: str) -> str:
    """--synthetic-acceptance in its canonical spelling ("" when not given); malformed: SpecplayError."""
    from engine.core.synthetic import SyntheticAcceptance

    profile = SyntheticAcceptance.parse(text or "")
    return "" if profile is None else profile.text


def check_synthetic_ks(config: GenerationConfig, ks: list) -> None:
    """A synthetic profile must fit every K a sweep measures: refused before anything loads."""
    for k in ks:
        replace(config, k=k).validate()


def _on_off_auto(value: str):
    return {"on": True, "off": False}.get(value)


def load_decoder(args, *method_names: str):
    """Load the model pair (the draft only when one of the methods needs it) and build the decoder."""
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import resolve_device, resolve_dtype

    CHATTER.hold_transformers()
    device = resolve_device(args.device)  # a missing GPU is reported before any model is read
    dtype = resolve_dtype(args.dtype, device)  # so is an unknown dtype
    if getattr(args, "synthetic", None):
        decoder = synthetic_decoder(args, method_names, device, dtype)[0]
    else:
        decoder = SpeculativeDecoder(_load_pair(args, method_names, device))
    if getattr(args, "heads", None):
        progress(f"loading the heads {args.heads}…")
        decoder.use_heads(args.heads)
    decoder.set_cuda_graphs(not getattr(args, "no_cuda_graphs", False))
    if decoder.backend.compiles_kernels:
        progress("compiling CUDA kernels…")
    decoder.warm_up()
    return decoder


def _load_pair(args, method_names, device):
    """The model pair of --target / --draft (the draft only when one of the methods needs it)."""
    from engine.models.loading import load_pair

    need_draft = any(methods.get(name).needs_draft_model for name in method_names)
    requested = getattr(args, "threads", None)
    if requested is not None:  # loading computes too
        apply_threads((), requested)
    progress(f"loading {args.target or 'the shipped target'}"
             + (f" and {args.draft or 'the shipped draft'}" if need_draft else "") + f" on {device}…")
    tp = getattr(args, "tp", 1)
    if tp != 1:
        from engine.models import tp as tensor_parallel
        pair = tensor_parallel.load_pair(args.target, args.draft, tp, device, need_draft, args.dtype)
    else:
        pair = load_pair(args.target, args.draft, device=device, need_draft=need_draft, dtype=args.dtype)
    if pair is not None:
        apply_threads((pair.target, pair.draft), requested)
    return pair


def synthetic_decoder(args, method_names, device, dtype) -> tuple:
    """(decoder, SyntheticPair): a random-weight pair of --synthetic's shape with random-weight heads of the
    published layouts for the head methods named (eagle, eagle3, medusa), built on the device; timing only."""
    from engine.core.decoder import SpeculativeDecoder
    from engine.methods import synthetic_heads
    from engine.models.synthetic import build_synthetic_pair, check_shape

    check_shape(args.synthetic)
    print(f"building a random-weight {args.synthetic} pair on {device} (timing only)…", file=sys.stderr)
    built = build_synthetic_pair(args.synthetic, device, dtype)
    apply_threads((built.pair.target, built.pair.draft), getattr(args, "threads", None))
    decoder = SpeculativeDecoder(built.pair)
    heads = synthetic_heads.build_heads(built.pair.target, args.synthetic, method_names)
    if heads:
        decoder.use_built_heads({method: head.head for method, head in heads.items()})
        print(synthetic_heads.describe(heads), file=sys.stderr)
    return decoder, built


# ------------------------------------------------------------------------------------------------ inputs
def prompt_from_args(args, default: Optional[str] = None) -> Optional[str]:
    """The prompt of --prompt or --prompt-file (default when neither), checked to be non-empty UTF-8."""
    if getattr(args, "prompt_file", None) is not None:
        prompt = _read_prompt_file(args.prompt_file)
    elif args.prompt is not None:
        prompt = args.prompt
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise SpecplayError(f"the prompt is not valid UTF-8 (at character {exc.start})") from None
    else:
        return default
    if not prompt.strip():
        raise SpecplayError("the prompt is empty")
    return prompt


def _read_prompt_file(path: str) -> str:
    if path == "-":
        data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise SpecplayError(f"--prompt-file - (stdin) is larger than {MAX_PROMPT_BYTES >> 20} MiB")
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise SpecplayError(f"--prompt-file - (stdin) is not valid UTF-8 (byte 0x{data[exc.start]:02x} "
                                f"at offset {exc.start})") from None
    return bounded.read_text(path, "--prompt-file", MAX_PROMPT_BYTES)


def check_common_args(args) -> None:
    """Checks every command's shared options before anything loads."""
    check_threads(getattr(args, "threads", None))
    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise SpecplayError(f"--tp {tp}: must be at least 1")
    if tp != 1 and (args.command == "gui" or getattr(args, "what", None) == "batch"
                    or getattr(args, "synthetic", None)):
        raise SpecplayError("--tp runs with run, check-lossless, bench methods|k-sweep|runtimes and predict "
                            "(not the GUI, bench batch or synthetic pairs yet)")
    for name in ("target", "draft"):
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            raise SpecplayError(f"--{name} is empty")


def export_targets(args) -> list:
    """[(path, format name)] for --csv and --trace; one file named twice is refused."""
    targets = [(path, fmt) for path, fmt in ((args.csv, "csv"), (args.trace, "jsonl")) if path is not None]
    if len(targets) == 2 and os.path.realpath(targets[0][0]) == os.path.realpath(targets[1][0]):
        raise SpecplayError(f"--csv and --trace name the same file ({args.csv})")
    return targets


HELD_IMPORTS = ("torch", "torch.distributed")  # their start-up runs C++ that calls back into Python


class _HoldSignalsWhileImporting:
    """A meta-path finder: while torch and torch.distributed execute their import (whoever imports them, once
    the command's input is checked), SIGINT and SIGTERM are only remembered, then raised through the handlers
    they met. A handler's exception inside that C++ cannot unwind through pybind11 and aborts the process
    (std::terminate: no "interrupted", no status 130)."""

    def __init__(self):
        self.depth = 0
        self.came: list = []
        self.previous: dict = {}

    def find_spec(self, name, path, target=None):
        if name not in HELD_IMPORTS or name in sys.modules:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module
            spec.loader.exec_module = lambda module: self.held(execute, module)
        return spec

    def held(self, execute, module) -> None:
        if self.depth == 0:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    self.previous[sig] = signal.signal(sig, lambda signum, frame: self.came.append(signum))
                except ValueError:  # not the main thread: no handler runs here
                    break
        self.depth += 1
        try:
            execute(module)
        finally:
            self.depth -= 1
            if self.depth == 0:
                for sig, old in self.previous.items():
                    signal.signal(sig, old)
                self.previous.clear()
                if self.came:
                    signal.raise_signal(self.came.pop(0))


@contextlib.contextmanager
def torch_imports_hold_signals():
    """While the block runs, torch's and torch.distributed's imports hold SIGINT and SIGTERM (see
    _HoldSignalsWhileImporting)."""
    finder = _HoldSignalsWhileImporting()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (the terminal closed): stop like Ctrl+C, keeping what was exported."""


@contextlib.contextmanager
def signals_as_interrupts():
    """SIGTERM and SIGHUP raise Interrupted while the block runs (main thread only)."""
    def handler(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        try:
            previous[sig] = signal.signal(sig, handler) if sig is not None else None
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            if old is not None:
                signal.signal(sig, old)


class BenchStop:
    """SIGINT and SIGTERM during a benchmark: the first, once measuring began, asks it to stop after the
    generation or K measured now, so that the rows measured are printed; a second one (or one before the
    measuring) stops at once. Used as a context manager around the command (main thread only)."""

    def __init__(self):
        self.measuring = False
        self.requested: Optional[str] = None
        self._previous: dict = {}

    def __enter__(self) -> "BenchStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.measuring or self.requested:
            raise Interrupted(name)
        self.requested = name
        _say(f"{name}: stopping after the measurement running now (again to stop at once)")

    def going(self, *_) -> bool:
        """A suite's progress callback: False once a stop was asked for."""
        return self.requested is None


# ------------------------------------------------------------------------------------------------ run
def cmd_run(args) -> int:
    config = config_from_args(args)
    if args.server and getattr(args, "prompts_file", None):
        raise SpecplayError("--server and --prompts-file: a served engine batches requests itself; measure "
                            "concurrent requests with bench server --clients")
    if getattr(args, "prompts_file", None):
        return batch_cli.cmd_run_batch(args, config)
    prompt = prompt_from_args(args)
    if prompt is None:
        raise SpecplayError("run needs --prompt, --prompt-file or --prompts-file")
    events: list = []
    targets = export_targets(args)
    if args.server:
        return server_cli.cmd_run_served(args, prompt, targets, lambda engine: _served_header(
            prompt, config, engine))
    try:
        with signals_as_interrupts(), contextlib.ExitStack() as stack:
            exports = [stack.enter_context(StreamingExport(path, FORMATS[fmt]())) for path, fmt in targets]
            decoder = load_decoder(args, config.method)
            header = run_header(args, prompt, config, decoder)
            for export in exports:
                export.start_run(header)
            label = methods.spec_label(config.method, config.tree_nodes)
            progress(f"generating {config.max_new_tokens} tokens with {label}…")
            for event in decoder.generate(prompt, config):
                events.append(event)
                for export in exports:
                    export.add(event, header["generation"])
    except KeyboardInterrupt:
        if events and not args.json:  # the text so far is the user's too
            print("".join(e.emitted_text for e in events), flush=True)
        kept = f"; kept in {', '.join(path for path, _ in targets)}" if targets and events else ""
        print(f"interrupted after {len(events)} rounds{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print_run(events, config, decoder, args.json)
    return 0


def cmd_export_heads(args) -> int:
    """`export-heads`: the heads in a public layout (engine/methods/export_heads.py); refusals in one line."""
    from pathlib import Path

    import torch

    from engine.methods import export_heads
    from engine.models.loading import resolve_model_dir, shipped_pair

    target = resolve_model_dir(args.target) if args.target else shipped_pair()[0]
    print(export_heads.export(args.format, args.out, Path(target), args.heads, getattr(torch, args.dtype)))
    return 0


def cmd_doctor(args) -> int:
    """`doctor`: the head doctor's report (engine/analysis/doctor.py)."""
    from engine.analysis import doctor

    if not 1 <= args.k <= MAX_K or not 1 <= args.prompts <= 64 or not 1 <= args.max_new_tokens <= 4096:
        raise SpecplayError(f"doctor takes --k 1..{MAX_K}, --prompts 1..64 and --max-new-tokens 1..4096")
    method = args.method
    if method is None and args.heads:
        from engine.methods import public_heads

        method = public_heads.detect(args.heads).method
    method = method or "eagle3"
    decoder = load_decoder(args, method)
    report = doctor.diagnose_heads(decoder, method, doctor.default_prompts(args.prompts), args.k,
                                   args.max_new_tokens)
    print(report.format())
    return 0


def cmd_heads(args) -> int:
    """Describe the heads and load them onto the target (a misfit is refused in one line, status 2)."""
    from engine.methods import public_heads

    info = public_heads.detect(args.heads_dir)
    args.heads = args.heads_dir
    load_decoder(args, *info.methods)
    print(info.describe())
    print("fits the target: yes")
    return 0


def _served_header(prompt: str, config: GenerationConfig, engine) -> dict:
    from engine.files.trace import make_header

    header = make_header(prompt, config, engine.label, None, engine.kind, None)
    header["served"] = engine.label
    return header


def _print_run(events: list, config: GenerationConfig, decoder, as_json: bool) -> None:
    summary = summarize(events, config)
    summary["text"] = "".join(e.emitted_text for e in events)
    summary["device"] = decoder.device_name
    pair = getattr(decoder, "pair", None)
    if pair is not None:  # which forward runs each model, and why where it is not the fast path
        from engine.models.loading import forward_paths

        summary["forward_path"] = forward_paths(pair.target, pair.draft)
    info = getattr(decoder, "heads_info", None)
    if info is not None and config.method in info.methods:
        summary["heads"] = info.describe()
    if as_json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        text = summary["text"]
        print(text, end="" if text.endswith("\n") else "\n", flush=True)  # the summary starts a line
        print("-" * 60, file=sys.stderr)
        print(format_summary(summary), file=sys.stderr)
        if "forward_path" in summary:
            print(f"path: {summary['forward_path']}", file=sys.stderr)
        if "heads" in summary:
            print(summary["heads"], file=sys.stderr)


def run_header(args, prompt: str, config: GenerationConfig, decoder) -> dict:
    """The trace header that reproduces this generation (prompt, settings, models, device, dtype,
    versions)."""
    from engine.files.trace import make_header

    dtype = getattr(getattr(decoder, "target", None), "dtype", None)
    uses_draft = methods.get(config.method).needs_draft_model  # else no draft model was loaded
    draft = (args.draft or ("shipped" if args.target is None else None)) if uses_draft else None
    header = make_header(prompt, config, args.target or "shipped", draft, decoder.device_name,
                         None if dtype is None else str(dtype).removeprefix("torch."),
                         prompt_ids=decoder.prompt_ids(prompt))
    if config.method == "suffix" and not config.suffix_corpus and hasattr(decoder, "suffix_memory"):
        from engine.methods.suffix.drafter import (
            memory_fingerprint,  # what the memory holds as the run begins
        )

        header["suffix_memory"] = memory_fingerprint(decoder.suffix_memory().held(), decoder.vocab_size)
    return header


def summarize(events: list, config: GenerationConfig) -> dict:
    """The settings, the generation's RoundMetrics and how it finished, as one flat dict."""
    settings = {"method": config.method, "k": config.k, "tree_nodes": config.tree_nodes,
                "temperature": config.sampling.temperature}
    finish = events[-1].finish_reason if events else None
    summary = {**settings, **asdict(final_metrics(events)), "finish_reason": finish}
    note = synthetic_note(config) if config.drafts else ""
    if note:  # the text is not the model's: said in every output
        summary.update(synthetic_acceptance=config.synthetic_acceptance, note=note)
    return summary


def format_summary(s: dict) -> str:
    """The run's summary, one fact a line. Plain decoding (method none) has no K and no α."""
    head = (f"method={s['method']} T={s['temperature']} device={s.get('device', '?')}\n"
            f"rounds={s['rounds']} emitted={s['emitted']}\n")
    tail = (f"TPOT={s['tpot_ms']:.2f} ms  {s['tokens_per_s']:.1f} tokens/s  finish={s['finish_reason']}\n"
            f"time: draft {s['draft_ms']:.1f} ms, verify {s['verify_ms']:.1f} ms, "
            f"overhead {s['overhead_ms']:.1f} ms")
    if s["method"] == "none":
        return head + tail
    tree = f" tree={s['tree_nodes']}" if s.get("tree_nodes") else ""
    drafting_rounds = sum(s["accepted_length_histogram"]) if s["drafted"] else 0
    note = f"{s['note']}\n" if s.get("note") else ""
    return (f"{note}method={s['method']} K={s['k']}{tree} T={s['temperature']} "
            f"device={s.get('device', '?')}\n"
            f"rounds={s['rounds']} drafted={s['drafted']} accepted={s['accepted']} emitted={s['emitted']}\n"
            f"acceptance rate α={s['acceptance_rate']:.3f}  "
            f"mean acceptance length={s['mean_acceptance_length']:.2f}\n"
            f"  ({ALPHA_DEFINITION}; {drafting_rounds} of {s['rounds']} rounds drafted)\n"
            f"tokens/forward={s['tokens_per_forward']:.2f} (analytic {s['analytic_tokens_per_forward']:.2f}, "
            f"per-position {s['per_position_tokens_per_forward']:.2f})\n" + tail + "\n"
            f"per-position acceptance: {' '.join(f'{a:.2f}' for a in s['per_position_acceptance']) or '-'}\n"
            f"accepted-length histogram: {s['accepted_length_histogram']}")


DEFAULT_CHECK_PROMPT = "def fibonacci(n):\n    "


def cmd_check_lossless(args) -> int:
    from engine.analysis.lossless import check_greedy, check_sampling, greedy_summary, sampling_summary

    check_int("--samples", args.samples, 10, MAX_SAMPLES)
    config = config_from_args(args)
    if config.synthetic:  # its verdicts are drawn, not the target's: there is nothing lossless to prove
        raise SpecplayError("check-lossless checks real verification: --synthetic-acceptance makes the "
                            "output not the model's by design")
    if config.method == "none":  # plain decoding against itself would pass and prove nothing
        raise SpecplayError("check-lossless compares a drafting method with plain decoding, and "
                            "--method none drafts nothing: pick one (draft, ngram, eagle, ...)")
    sampling = SamplingParams(args.sample_temperature, args.top_k, args.sample_top_p)
    sampled_config = GenerationConfig(method=config.method, k=config.k, sampling=sampling, seed=args.seed,
                                      tree_nodes=config.tree_nodes, draft_layers=config.draft_layers,
                                      suffix_corpus=config.suffix_corpus, ngram_corpus=config.ngram_corpus)
    sampled_config.validate()
    prompt = prompt_from_args(args, DEFAULT_CHECK_PROMPT)
    decoder = load_decoder(args, config.method)
    progress(f"greedy: comparing {config.max_new_tokens} tokens with plain decoding…")
    greedy = check_greedy(decoder, prompt, config)
    print(f"{greedy_summary(greedy)} method={config.spec}, K={config.k}")
    chi = check_sampling(decoder, prompt, sampled_config, samples=args.samples,
                         progress=SeedProgress("sampling (chi-squared)"))
    print(sampling_summary(chi, sampling))
    return 0 if greedy.passed and chi.passed else 1


BENCH_COLUMNS = {
    "methods": ["method", "k", "alpha", "mean_acceptance_length", "tokens_per_forward",
                "analytic_tokens_per_forward", "c", "textbook_speedup", "textbook_share", "tokens_per_s",
                "speedup"],
    "graphs": ["method", "k", "alpha", "eager_tokens_per_s", "graph_tokens_per_s", "graph_gain",
               "eager_speedup", "graph_speedup"],
    "k-sweep": ["k", "alpha", "tokens_per_forward", "analytic_tokens_per_forward", "tokens_per_s", "speedup",
                "predicted_speedup", "from_run_tokens_per_forward", "from_run_speedup", "textbook_speedup"],
    "layerskip": ["layers", "k", "alpha", "tokens_per_forward", "analytic_tokens_per_forward", "c",
                  "tokens_per_s", "speedup", "predicted_speedup"],
}


def cmd_bench(args) -> int:
    """Parse, load, run one engine.bench.suite function, print its table; stopped by SIGINT or SIGTERM, the
    rows measured so far (status 130)."""
    with BenchStop() as stop:
        return _bench(args, stop)


def _bench(args, stop: BenchStop) -> int:
    if args.what == "kernels":
        return _bench_kernels()
    if args.what == "runtimes":
        return _bench_runtimes(args)
    if args.what == "batch":
        return batch_cli.cmd_bench_batch(args, config_from_args(args), _parse_ks(args.ks or BENCH_KS))
    config = config_from_args(args)
    if args.what == "server" or (args.server and args.what == "k-sweep"):
        if not args.server:
            raise SpecplayError("bench server needs --server URL")
        return server_cli.cmd_bench_served(args, prompt_from_args(args, bench.heldout_prompts(1)[0]))
    if args.server:
        raise SpecplayError(f"--server works with run, bench server and bench k-sweep, not bench {args.what}")
    check_int("--prompts", args.prompts, 1, MAX_BENCH_COUNT)
    check_int("--repeats", args.repeats, 1, MAX_BENCH_COUNT)
    prompt = prompt_from_args(args)
    prompts = [prompt] if prompt else bench.heldout_prompts(args.prompts)
    if args.what == "k-sweep":
        if config.method == "none":
            raise SpecplayError("bench k-sweep measures a drafting method's K, and --method none drafts "
                                "nothing: pick one (draft, ngram, eagle, ...)")
        ks = _parse_ks(args.ks or BENCH_KS)
        check_synthetic_ks(config, ks)
        check_int("--passes", args.passes, 1, MAX_BENCH_COUNT)
        decoder = load_decoder(args, config.method)
        progress(f"calibrating, then measuring K = {', '.join(map(str, ks))}…")
        stop.measuring = True

        def k_done(row) -> bool:
            progress(f"  K = {row['k']} done of {len(ks)} Ks")
            return stop.going()

        rows, swept = bench.steadiest_k_sweep(decoder, prompts, config, ks, args.repeats, args.passes,
                                              progress=k_done)
        if swept > 1:
            print(f"the machine's speed moved during a sweep: swept {swept} times, the steadiest sweep shown",
                  file=sys.stderr)
        best = max(rows, key=lambda r: r["speedup"])
        print(f"fastest measured K = {best['k']} ({best['speedup']:.2f}x over plain decoding)",
              file=sys.stderr)
        if all("from_run_speedup" in r for r in rows):
            guess = max(rows, key=lambda r: r["from_run_speedup"])
            print(f"predicted from the K = {guess['from_run_k']} run alone: best K = {guess['k']} "
                  f"({guess['from_run_speedup']:.2f}x)", file=sys.stderr)
        unsteady = bench.sweep_steadiness(rows)
        if unsteady:
            print(f"warning: {unsteady}", file=sys.stderr)
    elif args.what == "layerskip":
        decoder = load_decoder(args, "layerskip")
        stop.measuring = True
        rows = bench.bench_layer_sweep(decoder, prompts, config, _parse_counts(args.ls, "--ls"), args.repeats,
                                       progress=stop.going)
    else:
        if args.methods.strip() == "all":
            # every method of the Method menu, the draft model's where there is one to load
            with_draft = args.target is None or args.draft is not None
            decoder = load_decoder(args, *(name for name in methods.NAMES if with_draft or name != "draft"))
            specs, left_out = methods.runnable_menu_specs(decoder.method_availability())
            for spec, reason in left_out.items():
                print(f"left out {spec}: {reason}", file=sys.stderr)
        else:
            specs = [s.strip() for s in args.methods.split(",") if s.strip()]
            decoder = load_decoder(args, *(methods.parse_spec(s).name for s in specs))
        progress(f"measuring {', '.join(specs)} on {len(prompts)} prompts…")
        stop.measuring = args.what == "methods"  # graphs: a signal stops at once
        if args.what == "graphs":
            rows = bench.bench_graphs(decoder, prompts, config, specs, args.repeats)
        else:
            rows = bench.bench_methods(decoder, prompts, config, specs, args.repeats, progress=stop.going,
                                       keep_partial=True)
    stop.measuring = False  # from here a signal stops at once
    if stop.requested and not rows:
        _say(f"interrupted ({stop.requested}) before a row was complete")
        return EXIT_INTERRUPTED
    print(f"device={decoder.device_name} prompts={len(prompts)} max_new_tokens={config.max_new_tokens} "
          f"T={config.sampling.temperature}")
    if synthetic_note(config):
        print(synthetic_note(config))
    print(bench.format_rows(rows, BENCH_COLUMNS[args.what]), flush=True)
    if stop.requested:
        _say(f"interrupted ({stop.requested}): the {len(rows)} rows measured before it are above")
        return EXIT_INTERRUPTED
    if args.what != "graphs":
        print(ALPHA_DEFINITION, file=sys.stderr)
    if args.what == "methods" and len(rows) > 1:
        best = max(rows, key=lambda r: r["speedup"])
        print(f"fastest measured method: {best['method']} ({best['speedup']:.2f}x over plain decoding)",
              file=sys.stderr)
    return 0


def _bench_runtimes(args) -> int:
    """specplay's methods and HF generate on one pair (a synthetic one with --synthetic), end to end."""
    import torch

    from engine.bench import runtimes
    from engine.models.loading import resolve_device, resolve_dtype

    config = config_from_args(args)
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    for spec in specs:
        methods.parse_spec(spec)
    if config.synthetic and "none" not in specs:  # the predictions' speedups are over plain decoding's
        specs.insert(0, "none")
    hf = [] if args.hf.strip() in ("", "none") else [h.strip() for h in args.hf.split(",") if h.strip()]
    unknown = [h for h in hf if h not in runtimes.HF_RUNTIMES]
    if unknown:
        choices = ", ".join(runtimes.HF_RUNTIMES)
        raise SpecplayError(f"unknown --hf runtime {unknown[0]!r}; choose from {choices}")
    check_int("--prompts", args.prompts, 1, MAX_BENCH_COUNT)
    ks = _parse_ks(args.ks) if args.ks else [config.k]
    check_synthetic_ks(config, ks)
    prompt = prompt_from_args(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.synthetic:
        decoder, built = synthetic_decoder(args, [methods.parse_spec(s).name for s in specs], device, dtype)
        hf_target, hf_draft = built.hf_target, built.hf_draft
    else:
        decoder = load_decoder(args, *(methods.parse_spec(s).name for s in specs))
        hf_target, hf_draft = (runtimes.load_hf_models(decoder.pair.target_name, decoder.pair.draft_name,
                                                       device, dtype) if hf else (None, None))
    decoder.set_cuda_graphs(not args.no_cuda_graphs)
    decoder.warm_up()
    prompts = [prompt] if prompt else bench.heldout_prompts(args.prompts)
    def report_row(row) -> None:
        print(f"  {row.runtime}: {row.tokens_per_s:.1f} tokens/s", file=sys.stderr)

    with torch.inference_mode():
        report = runtimes.bench_runtimes(decoder, prompts, config, specs, hf, hf_target, hf_draft, report_row,
                                         ks)
    if config.synthetic:  # E is known in advance: the cost model's prediction beside each measurement
        timed = [name for name in (methods.parse_spec(s).name for s in specs) if name not in report.left_out]
        progress("calibrating the cost model for the predictions…")
        costs = decoder.calibrate(config.k, methods_to_time=timed, sampling=config.sampling).costs
        runtimes.add_predictions(report, costs, config)
    if args.synthetic:
        print(f"synthetic {args.synthetic}: random weights, timing only", file=sys.stderr)
    print(json.dumps(report.as_dict()) if args.json else runtimes.format_report(report))
    return 0


def _prediction_costs(args, trace):
    """The cost model for predict / diagnose: --costs, --no-calibrate (None: trace only) or a calibration."""
    from engine.analysis.costmodel import CostModel

    if args.costs:
        text = bounded.read_text(args.costs, "the cost model", MAX_COSTS_BYTES)
        try:
            return CostModel.from_dict(json.loads(text))
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            raise SpecplayError(f"cannot read the cost model {args.costs}: {exc}") from None
    if args.no_calibrate:
        return None
    other = _other_models(args, trace)
    if other:  # the loaded models' costs would price another machine's rounds
        print(f"note: {other}; predicted from the trace's own phase times, not a calibration of the loaded "
              f"models (name the trace's models with --target/--draft to calibrate them)", file=sys.stderr)
        return None
    if args.save_costs:
        _check_writable(args.save_costs)
    decoder = load_decoder(args, trace.method)
    costs = decoder.calibrate(trace.k or 4, methods_to_time=[trace.method], sampling=trace.sampling).costs
    if args.save_costs:
        with open(args.save_costs, "w", encoding="utf-8") as handle:
            json.dump(costs.to_dict(), handle, indent=1)
    return costs


def _other_models(args, trace) -> Optional[str]:
    """Why the trace's models are not the ones --target/--draft would load, or None (the same, or unknown)."""
    from engine.files.trace import other_models

    uses_draft = trace.method in methods.NAMES and methods.get(trace.method).needs_draft_model
    return other_models(trace.header.get("models") or {}, args.target, args.draft, uses_draft)


def _check_writable(path: str) -> None:
    """Refuse a path that cannot be written before a long calibration, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise SpecplayError(f"cannot write {path}: not a writable file in an existing folder")


def cmd_predict(args) -> int:
    from engine.analysis.predict import format_report, load_trace, predict_from_trace

    ks = _parse_ks(args.ks)
    trace = load_trace(args.trace)
    report = predict_from_trace(trace, ks, _prediction_costs(args, trace))
    print(json.dumps(report.to_dict()) if args.json else format_report(report))
    return 0


def cmd_diagnose(args) -> int:
    from engine.analysis.diagnose import diagnose, format_diagnosis
    from engine.analysis.predict import load_trace

    ks = _parse_ks(args.ks)
    trace = load_trace(args.trace)
    result = diagnose(trace, _prediction_costs(args, trace), ks)
    if args.json:
        print(json.dumps({"findings": [asdict(f) for f in result.findings],
                          "bars": [asdict(b) for b in result.bars]}, ensure_ascii=False))
    else:
        print(format_diagnosis(result))
    return 0


def _parse_ks(text: str) -> list:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise SpecplayError(f"--ks must be a comma-separated list of integers (got {text!r})") from None
    if not ks or ks[0] < 1 or ks[-1] > MAX_K:
        raise SpecplayError(f"--ks values must be between 1 and {MAX_K}")
    return ks


def _parse_counts(text: str, option: str) -> list:
    """'1,2,3' -> [1, 2, 3]; '' -> [] (the default)."""
    try:
        return sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SpecplayError(f"{option} must be a comma-separated list of integers (got {text!r})") from None


def _bench_kernels() -> int:
    try:
        from engine.kernels.bench_kernels import format_table, run_kernel_bench
    except ImportError as exc:
        raise SpecplayError(f"kernel benchmark unavailable: {exc}") from None
    import torch

    if not torch.cuda.is_available():
        raise SpecplayError("bench kernels needs a CUDA GPU")
    print(format_table(run_kernel_bench()))
    return 0


def main(argv: Optional[list] = None, gui: Optional[Callable] = None) -> int:
    """Run one command. gui(args) -> exit code launches the desktop playground (main.py passes it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["gui"], ["train"]):  # long-lived: their warnings go out as they come
        return _run_command(argv, gui)
    with warnings.catch_warnings(record=True) as caught:
        CHATTER.reset(caught)
        try:
            code = _run_command(argv, gui)
        finally:
            CHATTER.stop_holding()
    if not CHATTER.folded_in:
        CHATTER.replay()
    return code


def _run_command(argv: list, gui: Optional[Callable]) -> int:
    try:
        args = build_parser().parse_args(argv)
        handlers = {"gui": gui or _no_gui, "run": cmd_run, "check-lossless": cmd_check_lossless,
                    "bench": cmd_bench, "train": _cmd_train, "predict": cmd_predict, "diagnose": cmd_diagnose,
                    "heads": cmd_heads, "doctor": cmd_doctor, "export-heads": cmd_export_heads}
        if args.command is None:
            raise SpecplayError("no command given (python main.py --help lists them)")
        check_common_args(args)
        with torch_imports_hold_signals():
            return handlers[args.command](args)
    except SpecplayError as exc:
        _say(f"error: {exc}{CHATTER.folded()}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug, not bad input: one line, full traceback on request
        if os.environ.get("SPECPLAY_DEBUG"):
            raise
        _say(f"internal error: {type(exc).__name__}: {exc}{CHATTER.folded()} "
             f"(set SPECPLAY_DEBUG=1 for the traceback)")
        return 1


def one_line(message: str) -> str:
    """A message as one printable line: line breaks folded, bytes that are not UTF-8 escaped."""
    folded = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return folded.encode("utf-8", "backslashreplace").decode("utf-8")


def _say(message: str) -> None:
    try:
        print(one_line(message), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or full: the exit code still tells
        pass


def _no_gui(args) -> int:
    raise SpecplayError("the desktop playground starts from main.py (python main.py gui)")


def _cmd_train(args) -> int:
    from engine.train.cli import run_train

    return run_train(args)
