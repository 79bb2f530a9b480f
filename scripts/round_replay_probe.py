"""A method's round as the GPU runs it, without the host: its captured round graph (engine.round_graph)
replayed back to back, timed by CUDA events, once per setting of the round's switches, settings interleaved.

    python scripts/round_replay_probe.py [--methods none,ngram,draft,eagle,eagle3,eagle3:8] [--passes 2]

On a small model a round's time is mostly its kernels' count, and on a slow host the host's share hides it
in `bench methods`; this shows what a change of the round's kernels does on the GPU alone. Each setting
builds its own decoder on the shipped pair (bf16), runs one greedy generation on a held-out prompt (which
captures the round graph and seeds it), then replays the graph: the drafting's graph and the round's,
REPLAYS times, continuing that generation's decoding on the device. Printed: microseconds per round
(drafting + the rest), and per plain step for `none`, beside the host's microseconds to queue a round's
replays (host_queue_us: where it is as long as the round, the launches set the pace, not the GPU).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPLAYS = 60  # rounds per timing (each appends up to K+1 rows to the caches: well inside the shipped 1024)
# (module, constant, value) per setting: this build's round change on (the defaults), and off: a greedy
# chain's verification, n-gram's cut and the readout (plain decoding's argmax and readout) launched apart
# rather than as one sp_greedy_readout. The programmatic launches of the greedy verification, readout
# and commit, n-gram's block in its lookup kernel, the tensor cores' short rows, Medusa's heads on the
# accepted row only and in one kernel, the round kernels, the rope's start, the heads' fused product and
# sp_gemv's rows reduced together were measured off and on before (docs/measurements/round_replay_*.txt).
SETTINGS = {
    "on": (),
    "off": (("engine.round_graph", "GREEDY_READOUT", False),),
}
_DEFAULTS: dict = {}  # (module, constant) -> its value as imported


def apply(setting: str) -> None:
    import importlib

    for module, name, _ in SETTINGS["off"]:
        loaded = importlib.import_module(module)
        setattr(loaded, name, _DEFAULTS.setdefault((module, name), getattr(loaded, name)))
    for module, name, value in SETTINGS[setting]:
        setattr(importlib.import_module(module), name, value)


def captured_graph(decoder, method: str, prompt: str, k: int):
    """The round graph a greedy generation replayed last (None if it replayed none)."""
    from engine.config import GenerationConfig
    from engine.decoder import SpeculativeDecoder

    seen = []
    original = SpeculativeDecoder._replay_round

    def spy(self, state, drafter, graph, *args, **kwargs):
        seen.append(graph)
        return original(self, state, drafter, graph, *args, **kwargs)

    SpeculativeDecoder._replay_round = spy
    try:
        config = GenerationConfig(k=k, max_new_tokens=96, stop_at_eos=False).with_spec(method)
        for _ in decoder.generate(prompt, config):
            pass
    finally:
        SpeculativeDecoder._replay_round = original
    return seen[-1] if seen else None


def replay_us(graph, replays: int, draft: bool = True, rest: bool = True) -> tuple:
    """(GPU microseconds per round, the host's microseconds to queue one): where the two are close, the
    host's launches, not the GPU, set the pace."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(replays):
        if draft:
            graph.replay_draft()
        if rest:
            graph.replay()
    queued = time.perf_counter() - began
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays, 1e6 * queued / replays


def probe(method: str, setting: str, prompt: str, k: int) -> dict:
    import torch

    from engine.decoder import SpeculativeDecoder
    from engine.models import load_pair

    apply(setting)
    pair = load_pair(None, None, device="cuda", need_draft=method == "draft")  # bf16, as bench methods
    decoder = SpeculativeDecoder(pair)
    decoder.warm_up()
    graph = captured_graph(decoder, method, prompt, k)
    if graph is None:
        return {"method": method, "setting": setting, "error": "no round graph replayed"}
    snapshot = {name: t.clone() for name, t in vars(graph).items() if isinstance(t, torch.Tensor)}

    def timed(**parts) -> tuple:
        for name, t in snapshot.items():  # every timing starts where the generation left the graph
            getattr(graph, name).copy_(t)
        replay_us(graph, 3, **parts)  # warm
        for name, t in snapshot.items():
            getattr(graph, name).copy_(t)
        return replay_us(graph, REPLAYS, **parts)

    (whole, host), (draft, _), (rest, rest_host) = timed(), timed(rest=False), timed(draft=False)
    row = {"method": method, "setting": setting, "round_us": round(whole, 2), "draft_us": round(draft, 2),
           "rest_us": round(rest, 2), "host_queue_us": round(host, 2),
           "rest_host_queue_us": round(rest_host, 2)}
    one = merged_graph(graph)
    if one is not None:  # the drafting and the rest captured as one graph: what the split costs
        for name, t in snapshot.items():
            getattr(graph, name).copy_(t)
        row["one_graph_us"] = round(replay_us(_OneGraph(one), REPLAYS, rest=True, draft=False)[0], 2)
    return row


class _OneGraph:
    def __init__(self, graph):
        self.graph = graph

    def replay_draft(self) -> None:
        pass

    def replay(self) -> None:
        self.graph.replay()


def merged_graph(graph):
    """A chain round's drafting and verification captured together in one CUDA graph (None: no split)."""
    import torch

    from engine.chain_graph import graph_pool
    from engine.runner import graph_capture

    if graph.draft_graph is None:
        return None
    one = torch.cuda.CUDAGraph()
    with graph_capture(one, graph_pool(graph.target), graph.target.device):
        graph._draft_round()
        graph._round()
    return one


def main() -> int:
    import torch

    from engine.bench import heldout_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="none,ngram,draft,eagle,eagle3,eagle3:8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: round_replay_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    prompt = heldout_prompts(1)[0]
    with torch.inference_mode():
        for method in args.methods.split(","):
            for _ in range(args.passes):
                for setting in ("off", "on"):
                    print(json.dumps(probe(method, setting, prompt, args.k)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
