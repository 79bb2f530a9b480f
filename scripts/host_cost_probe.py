"""Where a round's host time goes: each host step of the decoder's round loop timed by perf_counter (no
profiler), per method, on the shipped pair.

    python scripts/host_cost_probe.py [--methods none,ngram,eagle3] [--device cuda] [--tokens 128]

Prints microseconds per round for each step (the read includes the wait for the GPU; the replay, the
readout's copy, the graph lookup and the clock's marks are inside the launch) and the round's wall time.
Where the steps other than the read add up to more than the GPU's round, the host is the bottleneck.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = ("_read_round", "_accept", "_commit", "_launch_after", "_launch_round", "_event")
INNER_STEPS = ("_replay_round", "_copy_readout", "_round_graph")  # inside _launch_after
# inside _launch_round (_verify, _queue_readout), _commit (_roll_back) and _event (_details)
PARTS = ("_verify", "_queue_readout", "_roll_back", "_details")
# (module, class, method): the host drafters' own work and the target's forward, inside the steps above
INNER_CALLS = (("engine.llama", "LlamaRunner", "forward"),
               ("engine.drafters.suffix", "SuffixDrafter", "propose"),
               ("engine.drafters.suffix", "SuffixDrafter", "commit"),
               ("engine.drafters.lookahead", "LookaheadDrafter", "propose"),
               ("engine.drafters.lookahead", "LookaheadDrafter", "commit"))


def timed_steps(costs: dict):
    """Wrap the decoder's round steps (and the text's add) with timers adding into costs[name]."""
    from engine import decoder as decoder_module
    from engine import text as text_module

    originals = []

    def wrap(owner, name):
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                costs[name].append(time.perf_counter() - start)

        setattr(owner, name, timed)

    import importlib

    from engine import round_graph, timing

    for name in STEPS + INNER_STEPS + PARTS:
        wrap(decoder_module.SpeculativeDecoder, name)
    for module, owner, name in INNER_CALLS:
        cls = getattr(importlib.import_module(module), owner)
        wrap(cls, name)
    wrap(text_module.IncrementalText, "add")
    wrap(round_graph.RoundGraph, "replay")
    wrap(round_graph.RoundGraph, "replay_draft")
    wrap(timing.RoundClock, "mark")
    return originals


def primitives_us(device: str) -> dict:
    """The host's cost of a few primitives a round uses, 200 times each: a pinned host buffer (the
    readout's), a timing event made and recorded, an empty graph-free device op."""
    import torch

    if not device.startswith("cuda"):
        return {}
    out = {}

    def each(name, fn, n=200):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round(1e6 * (time.perf_counter() - start) / n, 2)

    from engine.cuda_calls import StreamCalls

    values = torch.zeros(300, device=device)
    host = torch.empty(300, pin_memory=True)
    stream = torch.cuda.current_stream()
    calls = StreamCalls(stream)
    each("pinned_empty", lambda: torch.empty(300, pin_memory=True))
    each("pinned_copy", lambda: torch.empty(300, pin_memory=True).copy_(values, non_blocking=True))
    each("torch_copy", lambda: host.copy_(values, non_blocking=True))
    each("event_record", lambda: torch.cuda.Event(enable_timing=True).record())
    each("event_record_on_stream", lambda: torch.cuda.Event(enable_timing=True).record(stream))
    if calls.raw:
        each("raw_copy", lambda: calls.copy_to_host(host, values))
        each("raw_event", calls.event)
        a, b = calls.event(), calls.event()
        torch.cuda.synchronize()
        each("raw_elapsed", lambda: a.elapsed_time(b))
        each("raw_synchronize", a.synchronize)
    ta, tb = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ta.record(stream)
    tb.record(stream)
    torch.cuda.synchronize()
    each("torch_elapsed", lambda: ta.elapsed_time(tb))
    each("torch_synchronize", ta.synchronize)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        values.add_(1)
    stream.wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(8):
            values.add_(1)
    each("torch_replay_8_nodes", graph.replay)
    if calls.raw:
        each("raw_launch_8_nodes", lambda: calls.launch(graph))
    torch.cuda.synchronize()
    return out


def main() -> int:
    from engine import cuda_calls
    from engine.bench import heldout_prompts
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram,eagle3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--raw-ab", action="store_true",
                        help="each method with torch's CUDA calls, then the raw ones (engine.cuda_calls)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    pair = load_pair(None, None, device=args.device, need_draft="draft" in methods)
    decoder = SpeculativeDecoder(pair)
    decoder.warm_up()
    prompts = heldout_prompts(args.prompts)
    print(json.dumps({"primitives_us": primitives_us(args.device)}), flush=True)
    costs: dict = collections.defaultdict(list)
    originals = timed_steps(costs)
    try:
        settings = (False, True) if args.raw_ab else (cuda_calls.RAW_CALLS,)
        for method, raw in ((m, r) for m in methods for r in settings):
            cuda_calls.RAW_CALLS, decoder._calls = raw, None
            config = GenerationConfig(k=args.k, max_new_tokens=args.tokens,
                                      stop_at_eos=False).with_spec(method)
            for prompt in prompts[:1]:  # captures and warm-up
                for _ in decoder.generate(prompt, config):
                    pass
            costs.clear()
            rounds, start = 0, time.perf_counter()
            for prompt in prompts:
                for _ in decoder.generate(prompt, config):
                    rounds += 1
            wall = time.perf_counter() - start
            row = {"method": method, "k": args.k, "raw_calls": raw, "rounds": rounds,
                   "wall_us_per_round": round(1e6 * wall / rounds, 1)}
            row.update({name: round(1e6 * sum(v) / rounds, 1) for name, v in costs.items()})
            row["calls"] = {name: len(v) for name, v in costs.items()}  # a step called on some rounds only
            row["longest_us"] = {name: round(1e6 * max(v), 1) for name, v in costs.items()}
            print(json.dumps(row), flush=True)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    return 0


if __name__ == "__main__":
    sys.exit(main())
