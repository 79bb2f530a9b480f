"""Headless command line: run, check-lossless, bench, train. Bad input -> one line on stderr, exit 2.

The `gui` command is parsed here but launched by the caller (main.py passes `gui=`): the engine never imports
the app."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Callable, Optional

from engine import batch_cli, bench, methods
from engine.config import MAX_K, GenerationConfig, SamplingParams
from engine.errors import SpecplayError
from engine.methods import MethodSpec
from engine.metrics import final_metrics, write_csv, write_jsonl

EXIT_BAD_INPUT = 2
METHOD_HELP = (f"{' | '.join(methods.NAMES)}; NAME:NODES for a tree of NODES nodes "
               f"(e.g. eagle:8, medusa:16)")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) and exit code 2."""

    def error(self, message):
        raise SpecplayError(message)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: a local Hugging Face directory or a cached Hub id "
                                    "(default: the shipped pair in assets/models)")
    p.add_argument("--draft", help="draft model (same forms as --target)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default=None,
                   help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the GPU forwards eagerly instead of replaying captured CUDA graphs")


def _add_generation_args(p: argparse.ArgumentParser, prompt_required: bool = True) -> None:
    p.add_argument("--prompt", required=prompt_required, help="the prompt text")
    p.add_argument("--method", default="draft", help=METHOD_HELP)
    p.add_argument("--k", type=int, default=4, help=f"tokens drafted per round (1..{MAX_K})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="the tree size, as --method NAME:NODES gives it (medusa: node budget, default 2K; "
                        "eagle: 0 = a chain of K, N = a dynamic tree of N nodes)")
    _add_model_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="main.py", description="specplay: a playground for speculative decoding")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    gui = sub.add_parser("gui", help="open the desktop playground (the default)")
    _add_model_args(gui)

    run = sub.add_parser("run", help="generate once and print the text and a summary")
    _add_generation_args(run, prompt_required=False)
    batch_cli.add_run_options(run)
    run.add_argument("--csv", help="write one row per round to this CSV file")
    run.add_argument("--trace", help="write the full RoundEvents to this JSONL file")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    check = sub.add_parser("check-lossless", help="prove speculation does not change the output")
    _add_generation_args(check, prompt_required=False)
    check.add_argument("--samples", type=int, default=2000, help="seeds for the chi-squared test")
    check.add_argument("--sample-temperature", type=float, default=0.8)
    check.add_argument("--sample-top-p", type=float, default=0.9)

    bench = sub.add_parser("bench", help="measured benchmarks (ratios side by side in one run)")
    bench.add_argument("what", choices=("methods", "k-sweep", "graphs", "kernels", "runtimes", "batch"))
    _add_generation_args(bench, prompt_required=False)
    bench.add_argument("--ks", default="1,2,3,4,6,8,12,16", help="K values for k-sweep")
    bench.add_argument("--methods", default="none,draft,ngram",
                       help=f"comma-separated methods for `bench methods` and `bench graphs`: {METHOD_HELP}")
    bench.add_argument("--prompts", type=int, default=4, help="held-out prompts to average over")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--hf", default="hf-eager,hf-assisted,hf-lookup",
                       help="runtimes: transformers generate variants beside specplay's methods "
                            "(hf-eager, hf-assisted, hf-lookup, hf-compile; 'none' for none)")
    bench.add_argument("--synthetic", default=None,
                       help="runtimes: a random-weight pair of a real shape instead of --target/--draft, "
                            "timing only (tiny, llama-1b, llama-3b, llama-7b, llama-8b)")
    bench.add_argument("--json", action="store_true", help="runtimes: print one JSON object")
    batch_cli.add_bench_options(bench)

    try:
        from engine.train.cli import add_train_parser
    except ImportError:
        pass
    else:
        add_train_parser(sub)
    return parser


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
                              seed=args.seed, max_new_tokens=args.max_new_tokens, tree_nodes=spec.tree_nodes)
    config.validate()
    return config


def load_decoder(args, *method_names: str):
    """Load the model pair (the draft only when one of the methods needs it) and build the decoder."""
    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair, resolve_device

    device = resolve_device(args.device)  # a missing GPU is reported before any model is read
    need_draft = any(methods.get(name).needs_draft_model for name in method_names)
    pair = load_pair(args.target, args.draft, device=device, need_draft=need_draft, dtype=args.dtype)
    decoder = SpeculativeDecoder(pair)
    decoder.set_cuda_graphs(not getattr(args, "no_cuda_graphs", False))
    if decoder.backend.compiles_kernels:
        print("compiling CUDA kernels…", file=sys.stderr, flush=True)
        decoder.backend.warm_up()
    return decoder


def _check_writable(path: Optional[str]) -> None:
    if path is None:
        return
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise SpecplayError(f"cannot write {path}: {exc.strerror or exc}") from None


def cmd_run(args) -> int:
    config = config_from_args(args)
    if args.prompts_file:
        return batch_cli.cmd_run_batch(args, config)
    if args.prompt is None:
        raise SpecplayError("run needs --prompt (or --prompts-file)")
    if not args.prompt.strip():
        raise SpecplayError("the prompt is empty")
    _check_writable(args.csv)
    _check_writable(args.trace)
    decoder = load_decoder(args, config.method)
    events = list(decoder.generate(args.prompt, config))
    if args.csv:
        write_csv(events, args.csv)
    if args.trace:
        write_jsonl(events, args.trace)
    summary = summarize(events, config)
    summary["text"] = "".join(e.emitted_text for e in events)
    summary["device"] = decoder.device_name
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(summary["text"])
        print("-" * 60, file=sys.stderr)
        print(format_summary(summary), file=sys.stderr)
    return 0


def summarize(events: list, config: GenerationConfig) -> dict:
    """The settings, the generation's RoundMetrics and how it finished, as one flat dict."""
    settings = {"method": config.method, "k": config.k, "tree_nodes": config.tree_nodes,
                "temperature": config.sampling.temperature}
    finish = events[-1].finish_reason if events else None
    return {**settings, **asdict(final_metrics(events)), "finish_reason": finish}


def format_summary(s: dict) -> str:
    tree = f" tree={s['tree_nodes']}" if s.get("tree_nodes") else ""
    return (f"method={s['method']} K={s['k']}{tree} T={s['temperature']} device={s.get('device', '?')}\n"
            f"rounds={s['rounds']} drafted={s['drafted']} accepted={s['accepted']} emitted={s['emitted']}\n"
            f"acceptance rate α={s['acceptance_rate']:.3f}  "
            f"mean acceptance length={s['mean_acceptance_length']:.2f}\n"
            f"tokens/forward={s['tokens_per_forward']:.2f} (analytic {s['analytic_tokens_per_forward']:.2f}, "
            f"per-position {s['per_position_tokens_per_forward']:.2f})\n"
            f"TPOT={s['tpot_ms']:.2f} ms  {s['tokens_per_s']:.1f} tokens/s  finish={s['finish_reason']}\n"
            f"time: draft {s['draft_ms']:.1f} ms, verify {s['verify_ms']:.1f} ms, "
            f"overhead {s['overhead_ms']:.1f} ms\n"
            f"per-position acceptance: {' '.join(f'{a:.2f}' for a in s['per_position_acceptance']) or '-'}\n"
            f"accepted-length histogram: {s['accepted_length_histogram']}")


DEFAULT_CHECK_PROMPT = "def fibonacci(n):\n    "


def cmd_check_lossless(args) -> int:
    from engine.lossless import check_greedy, check_sampling, greedy_summary, sampling_summary

    if args.prompt is not None and not args.prompt.strip():
        raise SpecplayError("the prompt is empty")
    if args.samples < 10:
        raise SpecplayError(f"--samples must be >= 10 (got {args.samples})")
    config = config_from_args(args)
    prompt = args.prompt or DEFAULT_CHECK_PROMPT
    decoder = load_decoder(args, config.method)
    greedy = check_greedy(decoder, prompt, config)
    print(f"{greedy_summary(greedy)} method={config.method}, K={config.k}")
    sampling = SamplingParams(args.sample_temperature, args.top_k, args.sample_top_p)
    sampled_config = GenerationConfig(method=config.method, k=config.k, sampling=sampling, seed=args.seed,
                                      tree_nodes=config.tree_nodes)
    sampled_config.validate()
    chi = check_sampling(decoder, prompt, sampled_config, samples=args.samples)
    print(sampling_summary(chi, sampling))
    return 0 if greedy.passed and chi.passed else 1


BENCH_COLUMNS = {
    "methods": ["method", "k", "alpha", "mean_acceptance_length", "tokens_per_forward",
                "analytic_tokens_per_forward", "tokens_per_s", "speedup"],
    "graphs": ["method", "k", "alpha", "eager_tokens_per_s", "graph_tokens_per_s", "graph_gain",
               "eager_speedup", "graph_speedup"],
    "k-sweep": ["k", "alpha", "tokens_per_forward", "analytic_tokens_per_forward", "tokens_per_s", "speedup",
                "predicted_speedup"],
}


def cmd_bench(args) -> int:
    """Parse, load, run one engine.bench function, print its table."""
    if args.what == "kernels":
        return _bench_kernels()
    if args.what == "runtimes":
        return _bench_runtimes(args)
    if args.what == "batch":
        return batch_cli.cmd_bench_batch(args, config_from_args(args), _parse_ks(args.ks))
    config = config_from_args(args)
    prompts = [args.prompt] if args.prompt else bench.heldout_prompts(args.prompts)
    if args.what == "k-sweep":
        ks = _parse_ks(args.ks)
        decoder = load_decoder(args, config.method)
        rows = bench.bench_k_sweep(decoder, prompts, config, ks, args.repeats)
        best = max(rows, key=lambda r: r["speedup"])
        print(f"fastest measured K = {best['k']} ({best['speedup']:.2f}x over plain decoding)",
              file=sys.stderr)
    else:
        specs = [s.strip() for s in args.methods.split(",") if s.strip()]
        decoder = load_decoder(args, *(methods.parse_spec(s).name for s in specs))
        run = bench.bench_graphs if args.what == "graphs" else bench.bench_methods
        rows = run(decoder, prompts, config, specs, args.repeats)
    print(f"device={decoder.device_name} prompts={len(prompts)} max_new_tokens={config.max_new_tokens} "
          f"T={config.sampling.temperature}")
    print(bench.format_rows(rows, BENCH_COLUMNS[args.what]))
    return 0


def _bench_runtimes(args) -> int:
    """specplay's methods and HF generate on one pair (a synthetic one with --synthetic), end to end."""
    import torch

    from engine import runtimes
    from engine.decoder import SpeculativeDecoder
    from engine.models import resolve_device, resolve_dtype

    config = config_from_args(args)
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    for spec in specs:
        methods.parse_spec(spec)
    hf = [] if args.hf.strip() in ("", "none") else [h.strip() for h in args.hf.split(",") if h.strip()]
    unknown = [h for h in hf if h not in runtimes.HF_RUNTIMES]
    if unknown:
        raise SpecplayError(f"unknown --hf runtime {unknown[0]!r}; choose from {', '.join(runtimes.HF_RUNTIMES)}")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.synthetic:
        from engine.synthetic import build_synthetic_pair

        print(f"building a random-weight {args.synthetic} pair on {device} (timing only)…", file=sys.stderr)
        built = build_synthetic_pair(args.synthetic, device, dtype)
        decoder, hf_target, hf_draft = SpeculativeDecoder(built.pair), built.hf_target, built.hf_draft
    else:
        decoder = load_decoder(args, *(methods.parse_spec(s).name for s in specs))
        hf_target, hf_draft = (runtimes.load_hf_models(decoder.pair.target_name, decoder.pair.draft_name,
                                                       device, dtype) if hf else (None, None))
    decoder.set_cuda_graphs(not args.no_cuda_graphs)
    if decoder.backend.compiles_kernels:
        decoder.backend.warm_up()
    prompts = [args.prompt] if args.prompt else bench.heldout_prompts(args.prompts)
    progress = (lambda row: print(f"  {row.runtime}: {row.tokens_per_s:.1f} tokens/s", file=sys.stderr))
    with torch.inference_mode():
        report = runtimes.bench_runtimes(decoder, prompts, config, specs, hf, hf_target, hf_draft, progress)
    if args.synthetic:
        print(f"synthetic {args.synthetic}: random weights, timing only", file=sys.stderr)
    print(json.dumps(report.as_dict()) if args.json else runtimes.format_report(report))
    return 0


def _parse_ks(text: str) -> list:
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise SpecplayError(f"--ks must be a comma-separated list of integers (got {text!r})") from None
    if not ks or ks[0] < 1 or ks[-1] > MAX_K:
        raise SpecplayError(f"--ks values must be between 1 and {MAX_K}")
    return ks


def _bench_kernels() -> int:
    try:
        from kernels.bench_kernels import format_table, run_kernel_bench
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
    try:
        args = build_parser().parse_args(argv)
        handlers = {"gui": gui or _no_gui, "run": cmd_run, "check-lossless": cmd_check_lossless,
                    "bench": cmd_bench, "train": _cmd_train}
        if args.command is None:
            raise SpecplayError("no command given (python main.py --help lists them)")
        return handlers[args.command](args)
    except SpecplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, not bad input: one line, full traceback on request
        if os.environ.get("SPECPLAY_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc} (set SPECPLAY_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


def _no_gui(args) -> int:
    raise SpecplayError("the desktop playground starts from main.py (python main.py gui)")


def _cmd_train(args) -> int:
    from engine.train.cli import run_train

    return run_train(args)
