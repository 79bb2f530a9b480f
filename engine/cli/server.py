"""The command-line glue of served engines: `run --server URL`, `bench k-sweep --server URL` and
`bench server` (on/off, a K sweep, concurrent clients, the equality check) against an OpenAI-compatible
server (engine/sources)."""
from __future__ import annotations

import contextlib
import json
import sys
from typing import Optional

from engine.errors import SpecplayError

SERVER_KINDS = ("llama.cpp", "vllm", "sglang", "openai")
MAX_CLIENTS = 64


def add_server_options(p, bench: bool = False) -> None:
    p.add_argument("--server", metavar="URL",
                   help="generate on an OpenAI-compatible server (llama.cpp, vLLM, SGLang) instead of the "
                        "local engine, e.g. http://127.0.0.1:8080")
    p.add_argument("--server-kind", choices=SERVER_KINDS, default=None,
                   help="the server's engine (default: detected where the server says; else openai)")
    p.add_argument("--server-timeout", type=float, default=60.0,
                   help="seconds of silence tolerated from the server before giving up")
    if bench:
        p.add_argument("--plain-server", metavar="URL",
                       help="server: the same model served without speculation (the 'off' arm where the "
                            "engine cannot turn drafting off per request)")
        p.add_argument("--k-sweep", default="", metavar="K,K,...",
                       help="server: the K values to measure (llama.cpp takes K per request)")
        p.add_argument("--clients", default="", metavar="N,N,...",
                       help="server: concurrent clients to measure on and off (the batch regime)")
        p.add_argument("--check-equal", action="store_true",
                       help="server: check that greedy text with speculation on equals off")


def engine_from_args(args, url: Optional[str] = None):
    from engine.sources.server import ServedEngine

    if not 0.1 <= args.server_timeout <= 3600:
        raise SpecplayError(f"--server-timeout {args.server_timeout}: must be between 0.1 and 3600 s")
    return ServedEngine.connect(url or args.server, args.server_kind, args.server_timeout)


def request_from_args(args, prompt: str, k: Optional[int] = None):
    from engine.sources.server import ServedRequest

    speculate = args.method != "none"
    return ServedRequest(prompt=prompt, max_tokens=args.max_new_tokens, temperature=args.temperature,
                         k=k if speculate else None, speculate=speculate, seed=args.seed)


def cmd_run_served(args, prompt: str, targets: list, header_of) -> int:
    """Generate once on the server: the text, then its figures (what the server did not give said so);
    --csv / --trace get the same rows as a local run. A failing server keeps the rounds received so far."""
    from engine.files.exports import FORMATS, StreamingExport
    from engine.sources.http import ServerError

    engine = engine_from_args(args)
    k = args.k if engine.per_request_k else None  # else the server's own K (said in the figures)
    generation = engine.generation(request_from_args(args, prompt, k))
    header = header_of(engine)
    failure: Optional[ServerError] = None
    with contextlib.ExitStack() as stack:
        exports = [stack.enter_context(StreamingExport(path, FORMATS[fmt]())) for path, fmt in targets]
        for export in exports:
            export.start_run(header)
        try:
            for event in generation:
                for export in exports:
                    export.add(event, header["generation"])
        except ServerError as exc:
            failure = exc
    result = generation.result
    if failure is not None:
        kept = f"; {len(result.rounds)} rounds kept" + (
            f" in {', '.join(path for path, _ in targets)}" if targets and result.rounds else "")
        raise SpecplayError(f"{failure}{kept}")
    figures = dict(result.figures(), server=engine.label, text=result.text)
    if args.json:
        print(json.dumps(figures, ensure_ascii=False))
    else:
        print(result.text, end="" if result.text.endswith("\n") else "\n", flush=True)
        print("-" * 60, file=sys.stderr)
        print(format_figures(figures), file=sys.stderr)
    return 0


def format_figures(f: dict) -> str:
    """A served generation's figures, one fact a line; what the server did not give is named, never 0."""
    def val(key, fmt="{:.3f}", unit=""):
        value = f.get(key)
        return "not given by the server" if value is None else fmt.format(value) + unit

    not_given = "not given by the server"
    per_pos = " ".join(f"{a:.2f}" for a in f.get("per_position_acceptance") or []) or not_given
    return (f"server: {f.get('server', '?')}  K={f.get('k') or 'server default'}  finish={f.get('finish')}\n"
            f"tokens={f['tokens']}  TTFT={val('ttft_ms', '{:.1f}', ' ms')}  "
            f"TPOT={val('tpot_ms', '{:.2f}', ' ms')}  {val('tokens_per_s', '{:.1f}', ' tokens/s')}\n"
            f"drafted={val('draft_tokens', '{}')}  accepted={val('accepted', '{}')}  "
            f"verification steps that drafted={val('drafts', '{}')}\n"
            f"acceptance rate α={val('alpha')}  tokens/step={val('tokens_per_step', '{:.2f}')} "
            f"(analytic (1-α^(K+1))/(1-α) = {val('analytic_tokens_per_step', '{:.2f}')})\n"
            f"per-position acceptance: {per_pos}\n"
            "per token p, q, u and the draft/verify split: not given by the server")


def cmd_bench_served(args, prompt: str) -> int:
    """bench server (and bench k-sweep --server): the tuning loop, a table a part."""
    from engine.sources import tuning

    engine = engine_from_args(args)
    plain = engine_from_args(args, args.plain_server) if getattr(args, "plain_server", None) else None
    arms = tuning.Arms(engine, plain)
    request = request_from_args(args, prompt, args.k if engine.per_request_k else None)
    from engine.bench.suite import DEFAULT_KS

    swept = (args.ks or DEFAULT_KS) if args.what == "k-sweep" else ""
    ks = _counts(getattr(args, "k_sweep", "") or swept, "--k-sweep", 32)
    clients = _counts(getattr(args, "clients", ""), "--clients", MAX_CLIENTS)
    print(f"server: {engine.label}" + (f"  plain: {plain.label}" if plain else ""))
    row = tuning.on_off(arms, request)
    print(f"on/off (K={row['on']['k'] or 'n/a'}): on {_f(row['on']['tokens_per_s'])} tokens/s, off "
          f"{_f(row['off']['tokens_per_s'])} tokens/s, speedup {_f(row['speedup'], 2)}x, "
          f"α={_f(row['on']['alpha'], 3)}, TPOT on {_f(row['on']['tpot_ms'], 2)} ms / off "
          f"{_f(row['off']['tpot_ms'], 2)} ms, TTFT on {_f(row['on']['ttft_ms'])} ms")
    if ks:
        print(f"{'K':>3} {'α':>6} {'tok/step':>8} {'analytic':>8} {'tokens/s':>9} {'speedup':>7}  "
              "per-position")
        for r in tuning.k_sweep(arms, request, ks):
            per_pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]) or "-"
            print(f"{r['k']:>3} {_f(r['alpha'], 3):>6} {_f(r['tokens_per_step'], 2):>8} "
                  f"{_f(r['analytic_tokens_per_step'], 2):>8} {_f(r['tokens_per_s']):>9} "
                  f"{_f(r['speedup'], 2):>7}  {per_pos}")
    if clients:
        print(f"{'clients':>7} {'on tok/s':>9} {'off tok/s':>9} {'speedup':>7} {'α':>6} equal")
        for r in tuning.client_sweep(arms, request, clients):
            print(f"{r['clients']:>7} {_f(r['on_tokens_per_s']):>9} {_f(r['off_tokens_per_s']):>9} "
                  f"{_f(r['speedup'], 2):>7} {_f(r['alpha'], 3):>6} {'yes' if r['equal'] else 'NO'}")
    if getattr(args, "check_equal", False):
        check = tuning.check_equal(arms, request)
        if not check["equal"]:
            print(f"equality: FAIL, greedy text with speculation on and off part at character "
                  f"{check['diverges_at']}")
            return 1
        print(f"equality: PASS, greedy text with speculation on equals off ({check['tokens']} tokens)")
    return 0


def _counts(text: str, option: str, limit: int) -> list:
    try:
        values = sorted({int(v) for v in str(text).split(",") if v.strip()})
    except ValueError:
        raise SpecplayError(f"{option} must be a comma-separated list of integers (got {text!r})") from None
    if values and (values[0] < 1 or values[-1] > limit):
        raise SpecplayError(f"{option} values must be between 1 and {limit}")
    return values


def _f(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
