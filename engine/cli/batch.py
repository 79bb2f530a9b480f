"""The command-line glue of batched decoding: `run --prompts-file F` and `bench batch`.

Apart from engine/core/batch.py so that engine.cli.main stays light to import (no torch until a command runs).
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

from engine.config import GenerationConfig
from engine.errors import SpecplayError
from engine.files import bounded
from engine.methods import registry as methods

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"
CPU_MAX_BATCH = 64  # the largest batch bench batch measures on the CPU (see _batches)
CPU_BATCHES = "1,2,4,8,16,32"  # the default on the CPU (each round decodes every sequence on a few cores)
BENCH_NEW_TOKENS = 64  # bench batch's tokens per sequence: B x context bounds the KV cache's memory
MAX_PROMPTS_BYTES = 64 << 20
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def add_run_options(run) -> None:
    """The batch options of `run` (engine.cli.main calls this)."""
    run.add_argument("--prompts-file", help="decode every line of this file as one batch (one prompt a line, "
                                            "\\n for a newline); methods none, draft, ngram, eagle (a chain)")


def add_bench_options(bench) -> None:
    """The options of `bench batch` (engine.cli.main calls this)."""
    bench.add_argument("--batches", default=None,
                       help=f"batch: comma-separated batch sizes (default {DEFAULT_BATCHES}; on the CPU "
                            f"{CPU_BATCHES}, at most {CPU_MAX_BATCH})")
    bench.add_argument("--batch-new-tokens", type=int, default=BENCH_NEW_TOKENS,
                       help="batch: new tokens per sequence (--max-new-tokens is not used there)")
    bench.add_argument("--sweep-k", action="store_true",
                       help="batch: also measure every K of --ks at every batch (slow); "
                            "else the best K is predicted")
    bench.add_argument("--prompts-file",
                       help="batch: prompts, one a line (default: the held-out prompts, cycled)")
    bench.add_argument("--acceptance", type=float, default=None,
                       help="batch: the same as --synthetic-acceptance A, (each drafted token accepted with "
                            "probability A whatever the target says; the output is not the model's)")


def read_prompts_file(path: str) -> list:
    """Non-blank lines of path, with \\n, \\t and \\\\ unescaped; SpecplayError when unreadable or empty."""
    lines = bounded.read_text(path, "--prompts-file", MAX_PROMPTS_BYTES).splitlines()
    prompts = [_unescape(line) for line in lines if line.strip()]
    if not prompts:
        raise SpecplayError(f"--prompts-file {path} holds no prompts")
    return prompts


def _unescape(line: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), line)


def parse_batches(text: str) -> list:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SpecplayError(f"--batches must be comma-separated integers (got {text!r})") from None
    if not batches or min(batches) < 1 or max(batches) > 4096:
        raise SpecplayError(f"--batches values must be between 1 and 4096 (got {text!r})")
    return sorted(set(batches))


def _load(args, method: str):
    """The model pair (a synthetic one with --synthetic) as a BatchDecoder, kernels warmed up."""
    from engine.models.loading import load_pair, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    eagle_head = None
    if getattr(args, "synthetic", None):
        from engine.models.synthetic import build_synthetic_pair, check_shape

        check_shape(args.synthetic)
        print(f"building a random-weight {args.synthetic} pair on {device} (timing only)…", file=sys.stderr)
        pair = build_synthetic_pair(args.synthetic, device, resolve_dtype(args.dtype, device)).pair
        if method == "eagle":  # a random head of the layout batched EAGLE runs, built with the pair
            from engine.methods import synthetic_heads

            eagle_head = synthetic_heads.batch_eagle_head(pair.target)
            print("synthetic eagle head: the project's layout at the target's shape (fc [H, 2H], one layer, "
                  "the target's LM head), random weights", file=sys.stderr)
    else:
        pair = load_pair(args.target, args.draft, device=device, need_draft=method == "draft",
                         dtype=args.dtype)
    from engine.core.batch import BatchDecoder

    decoder = BatchDecoder(pair, eagle_head=eagle_head)
    decoder.use_graphs = decoder.use_graphs and not args.no_cuda_graphs
    if decoder.backend.compiles_kernels:
        print("compiling CUDA kernels…", file=sys.stderr, flush=True)
        decoder.backend.warm_up()
    return decoder


def _check_method(config: GenerationConfig, what: str, drafting: bool = False) -> None:
    """A batched method (a drafting one when drafting); EAGLE as its chain only."""
    if config.method not in methods.BATCH_METHODS or (drafting and config.method == "none"):
        raise SpecplayError(f"{what} (got {config.method!r})")
    if config.method == "eagle" and config.tree_nodes:
        raise SpecplayError(f"{what}; batched EAGLE drafts a chain of K: --method eagle, not "
                            f"eagle:{config.tree_nodes}")


def _synthetic(config: GenerationConfig, acceptance) -> str:
    """The run's synthetic profile: --synthetic-acceptance, or --acceptance A as the rate A at every
    position (engine.core.synthetic); both given: refused."""
    if acceptance is None:
        return config.synthetic_acceptance
    if config.synthetic:
        raise SpecplayError("give --synthetic-acceptance or --acceptance, not both")
    if not 0.0 <= acceptance <= 1.0:  # NaN fails this too
        raise SpecplayError(f"--acceptance must be in [0, 1] (got {acceptance})")
    return f"{acceptance:g},"


def cmd_run_batch(args, config: GenerationConfig) -> int:
    """`run --prompts-file F`: every line of F decoded as one batch; each text printed (or one JSON object a
    prompt, then the batch's summary)."""
    if args.csv or args.trace:
        raise SpecplayError("--csv and --trace record one generation's rounds; "
                            "they do not take --prompts-file")
    _check_method(config, f"--prompts-file decodes methods {', '.join(methods.BATCH_METHODS)}")
    prompts = read_prompts_file(args.prompts_file)
    decoder = _load(args, config.method)
    result = decoder.generate(prompts, config)
    summary = result.summary()
    if args.json:
        for prompt, seq in zip(prompts, result.sequences, strict=True):
            print(json.dumps({"prompt": prompt, **seq.as_dict()}, ensure_ascii=False))
        print(json.dumps({"batch": summary}, ensure_ascii=False))
        return 0
    for seq in result.sequences:
        print(f"=== prompt {seq.index + 1} ({len(seq.ids)} tokens, {seq.finish_reason})")
        print(seq.text)
    print(f"batch of {summary['batch']}: {summary['tokens']} tokens in {summary['rounds']} rounds, "
          f"{summary['tokens_per_s']:.1f} tokens/s, {summary['tokens_per_round']:.2f} tokens/sequence/round, "
          f"α={summary['acceptance_rate']:.3f} device={summary['device']}", file=sys.stderr)
    return 0


def _batches(args) -> list:
    """The batch sizes to measure. On the CPU a round of batch B decodes B sequences on a few cores: the
    default stops at 32, and past CPU_MAX_BATCH a run is refused up front (one batch would take minutes with
    nothing to show)."""
    from engine.models.loading import resolve_device

    on_cpu = resolve_device(args.device).type == "cpu"
    default = CPU_BATCHES if on_cpu else DEFAULT_BATCHES
    batches = parse_batches(default if args.batches is None else args.batches)
    if on_cpu and max(batches) > CPU_MAX_BATCH:
        raise SpecplayError(f"bench batch on the CPU measures batches up to {CPU_MAX_BATCH} (got "
                            f"{max(batches)}): each round decodes every sequence of the batch on the CPU's "
                            "cores; use --device cuda or smaller --batches")
    return batches


def cmd_bench_batch(args, config: GenerationConfig, ks: list) -> int:
    """`bench batch`: the measured gain-versus-batch curve and its roofline prediction."""
    from engine.bench import batch as batch_bench
    from engine.bench.suite import heldout_prompts

    batches = _batches(args)
    if args.batch_new_tokens < 1:
        raise SpecplayError(f"--batch-new-tokens must be >= 1 (got {args.batch_new_tokens})")
    _check_method(config, "bench batch compares a drafting method with plain decoding: --method draft, "
                          "ngram or eagle", drafting=True)
    if args.prompts_file:
        prompts = read_prompts_file(args.prompts_file)
    else:
        prompts = [args.prompt] if args.prompt else heldout_prompts(args.prompts)
    config = replace(config, max_new_tokens=args.batch_new_tokens,
                     synthetic_acceptance=_synthetic(config, args.acceptance))
    for k in ks if args.sweep_k else ():  # a profile must fit every K measured, checked before loading
        replace(config, k=k).validate()
    decoder = _load(args, config.method)

    def progress(row) -> None:
        print(f"  B={row.batch}: plain {row.plain_tokens_per_s:.1f} tokens/s, speculative "
              f"{row.spec_tokens_per_s:.1f} tokens/s ({row.speedup:.2f}x)", file=sys.stderr, flush=True)

    report = batch_bench.bench_batch(decoder, prompts, config, batches, ks, args.sweep_k, progress,
                                     repeats=args.repeats)
    notes = [f"synthetic {args.synthetic}: random weights, timing only"] if args.synthetic else []
    if config.synthetic:
        from engine.core.synthetic import synthetic_note

        notes.append(synthetic_note(config))
    report.note = "; ".join(notes)
    print(json.dumps(report.as_dict()) if args.json else batch_bench.format_report(report))
    return 0
