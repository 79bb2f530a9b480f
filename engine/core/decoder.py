"""The round loop: draft -> verify with one target forward -> accept -> roll back caches -> RoundEvent.

Plain decoding ("none") is the same loop with an empty draft, so every method shares one code path and the
baseline is measured exactly like the speculative runs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch

from engine.bench.timing import RoundClock, Stopwatch
from engine.config import GenerationConfig
from engine.core.graphs import chain_sampling, host_tree_round_graph, plain_round_graph
from engine.core.metrics import MetricsAccumulator
from engine.core.synthetic import profile_of
from engine.core.text import IncrementalText
from engine.errors import SpecplayError
from engine.events import DraftedToken, RoundEvent
from engine.kernels import REFERENCE, select_backend
from engine.kernels.cuda_calls import stream_calls
from engine.methods import registry as methods
from engine.methods.base import DecodeState, Draft, Drafter, DraftStart, NoDrafter, RoundCommit
from engine.models.runner import to_device
from engine.tuning import ENVIRONMENT, Tuning

TOP_ALTERNATIVES = 5
NAN_MESSAGE = "the target model produced NaN logits (a numerical overflow? try --dtype float32)"
# the target's decode steps captured at warm-up: blocks of 1..17 rows (a round of K <= 16, a tree of 16)
WARM_STEP_ROWS = 17


@dataclass
class Calibration:
    """What calibration measured: TPOT_plain, the draft model's step and, behind them, the full cost model."""

    target_step_ms: float  # a plain round (one-token verification + its bookkeeping): TPOT_plain
    draft_step_ms: float  # one draft-model step (0 without a draft model)
    # engine.analysis.costmodel.CostModel: curves and per-method terms with spread
    costs: Optional[object] = None

    @property
    def c(self) -> float:
        """The draft model's c: one draft step over one plain verification."""
        if self.costs is not None:
            return self.costs.c("draft")
        return self.draft_step_ms / self.target_step_ms if self.target_step_ms > 0 else 0.0

    def c_for(self, method: str) -> float:
        """The textbook c of a method (measured for every method, not only the draft model)."""
        if self.costs is not None:
            return self.costs.c(method)
        return self.c if method == "draft" else 0.0


@dataclass
class _RoundOutcome:
    accepted: int
    next_token: int
    path: list  # accepted node indices
    emitted: list  # token ids appended to the output this round
    finish_reason: Optional[str]


@dataclass
class _Launched:
    """A round queued on the device, not yet read back."""

    clock: RoundClock
    draft: Draft
    block_start: int  # the target cache row of the block's first token
    logits: torch.Tensor  # [N+1, V]
    features: torch.Tensor  # [N+1, H]
    result: object  # kernels' VerifyResult (device tensors)
    uniforms: Optional[torch.Tensor]  # [N+1] on the host, None when greedy
    readout: "_QueuedReadout"  # the round's figures, on their way to the host
    # the round graph's replay queued behind this one before this one was read, which took this round's
    # outcome on the device (SpeculativeDecoder._replay_round); its block_start is set once this one is read
    successor: Optional["_Launched"] = None
    # a replay whose chain has K slots and a count of real drafts known on the device only (n-gram): its
    # readout ends with the count, its draft is cut to it when read, and its block had K+1 rows whatever it
    counted: bool = False
    # the round's graph moved the accepted path down in the target's cache itself (a host tree's replay)
    compacted: bool = False

    @property
    def next_token_on_device(self) -> torch.Tensor:
        """[1] the round's correction or bonus token, still on the device (-1, the NaN flag, made 0 so that a
        round queued after it stays valid; reading this round raises)."""
        return self.result.next_token[:1].clamp_min(0)


@dataclass
class _QueuedReadout:
    """The round's readout (SpeculativeDecoder._queue_readout): its values and a device tree's parents in
    host memory, complete once `copied` has (None: on the CPU, complete already)."""

    values: torch.Tensor  # [flat] float32 on the host
    width: int  # top alternatives per row
    parents: Optional[torch.Tensor]  # [N] int64 on the host: a device tree's shape, else None
    copied: Optional[torch.cuda.Event]

    def wait(self) -> list:
        if self.copied is not None:
            self.copied.synchronize()
        return self.values.tolist()


@dataclass
class _RoundReadout:
    """A round's figures on the host (see SpeculativeDecoder._read_round)."""

    next_token: int
    path: list  # accepted node indices
    draft_tokens: list
    p: list  # [N] target probability of each drafted token
    q: list  # [N] its draft probability
    accept_prob: list  # [N]
    tested: list  # [N] 0/1
    next_p: float
    top_p: list  # [N+1][T]
    top_i: list  # [N+1][T] token ids

    @classmethod
    def unpack(cls, values: list, n: int, width: int, keep: Optional[int] = None) -> "_RoundReadout":
        """values: the flat copy _read_round makes (ids travel as float32: exact below 2**24): accepted, next
        token, then path, draft tokens, p, q, accept_prob and tested [n each], next_p [n+1], top_p and top_i
        [(n+1) * width each]. keep: the readout of the first `keep` drafted tokens only (a chain cut at its
        real drafts; its accepted path lies within them). Read by offsets, each field sliced once: this runs
        on the host every round."""
        accepted, next_token = int(values[0]), int(values[1])
        if accepted < 0 or next_token < 0:  # the CUDA kernels flag NaN logits with -1 (no extra sync)
            raise SpecplayError(NAN_MESSAGE)
        kept = n if keep is None else keep
        at, rows = 2, kept + 1

        def piece(size: int, stride: int) -> list:
            nonlocal at
            start, at = at, at + stride
            return values[start:start + size]

        path = list(map(int, piece(min(accepted, n), n)))
        draft_tokens = list(map(int, piece(kept, n)))
        p, q, accept_prob, tested = (piece(kept, n) for _ in range(4))
        next_p = piece(rows, n + 1)
        next_row = path[-1] + 1 if path else 0  # the block row whose distribution gave the next token
        top_p = [values[at + r * width:at + (r + 1) * width] for r in range(rows)]
        at += (n + 1) * width
        top_i = [list(map(int, values[at + r * width:at + (r + 1) * width])) for r in range(rows)]
        return cls(next_token=next_token, path=path, draft_tokens=draft_tokens, p=p, q=q,
                   accept_prob=accept_prob, tested=tested, next_p=next_p[next_row], top_p=top_p, top_i=top_i)


class SpeculativeDecoder:
    def __init__(self, pair, backend=None, tuning: Tuning = ENVIRONMENT):
        """pair: engine.models.loading.ModelPair (target runner, optional draft runner, tokenizer); tuning:
        the switches this decoder runs with (engine.tuning; the process's environment by default)."""
        self.pair = pair
        self.target = pair.target
        self.tokenizer = pair.tokenizer
        self.device = self.target.device
        self.tuning = tuning
        self.backend = backend or (select_backend(self.device) if tuning.kernels else REFERENCE)
        self.vocab_size = pair.vocab_size  # the target's logit width (its whole distribution)
        self.eos_ids = eos_ids(self.tokenizer)
        self._token_texts: dict = {}  # token id -> its text, decoded once
        self._medusa = None  # heads load on first use
        self._eagle = None
        self._eagle3 = None
        self.heads_info = None  # published heads from their own folder (use_heads), else the target's own
        self.built_heads: tuple = ()  # the methods of ready head objects handed over (use_built_heads)
        self._suffix_memory = None  # the session's prompts and outputs, for suffix decoding
        self._ngram_table = False  # the target's corpus table for n-gram (False: not looked for yet)
        self._calls = None  # the generation's stream's CUDA calls (engine.kernels.cuda_calls), looked up once
        self._pinned = PinnedRing()  # the readouts' host buffers
        self.pipelined = self.device.type == "cuda"  # see _rounds
        self.set_cuda_graphs(True)
        if self.device.type == "cuda":
            attention_without_plans()

    # ------------------------------------------------------------------------------------------ public API
    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "CPU"

    def warm_up(self) -> None:
        """The one-off work, before the first prompt: the backend's kernels, and on CUDA a prefill of each
        bucket (LlamaRunner.warm_up_buckets) on the target and the draft model, so that a first prefill finds
        its captured step and cuBLAS's choices made (a first prefill of 27 tokens: 20 ms unpadded and cold,
        1.6 ms padded and warmed, 1B shape, bf16, H200), the target's decode steps of every block size a
        round of K <= 16 may verify (LlamaRunner.warm_up_steps) and the verification of host-drafted trees of
        up to 16 nodes. A no-op on the CPU."""
        self.backend.warm_up()
        if self.device.type != "cuda":
            return
        from engine.models.llama import LlamaRunner

        with torch.inference_mode():
            for runner in (self.target, self.pair.draft):
                if isinstance(runner, LlamaRunner):
                    runner.warm_up_buckets()
            if isinstance(self.target, LlamaRunner):
                self.target.warm_up_steps(WARM_STEP_ROWS)
                self._warm_up_host_trees()

    def _warm_up_host_trees(self) -> None:
        """Capture the greedy verification graphs of host-drafted trees of 0..16 nodes (HostTreeRoundGraph):
        a suffix tree's size changes from round to round, and a size first met inside a generation would be
        captured there, a few ms each. Sampled ones are captured when first used (they depend on the
        settings). A tree drafted on the host is verified by one replay after one upload where it applies."""
        width = min(TOP_ALTERNATIVES, self.vocab_size)
        for nodes in range(WARM_STEP_ROWS):
            host_tree_round_graph(self.target, nodes, self.backend, width)

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Replay captured CUDA graphs for the Llama-family forwards (the default on GPU, unless the tuning
        turns graphs off), or run eagerly. Also applies the tuning's kernels switch to every runner in use
        (heads load later and come through here)."""
        self.cuda_graphs = bool(enabled) and self.device.type == "cuda" and self.tuning.graphs
        runners = [self.target, self.pair.draft] + [head.runner for head in (self._eagle, self._eagle3)
                                                    if head is not None]
        for runner in runners:
            if hasattr(runner, "use_graphs"):
                runner.use_graphs = self.cuda_graphs
            if not self.tuning.kernels and hasattr(runner, "use_torch_twins"):
                runner.use_torch_twins()

    def method_availability(self) -> dict:
        """Method name -> None when available, else the reason it is not (engine.methods.registry decides;
        heads opened with use_heads or handed over with use_built_heads make their methods available on a
        target that can run them)."""
        available = methods.availability(self.pair.draft is not None, self.target.supports_tree,
                                          str(self.pair.target_name))
        given = (self.heads_info.methods if self.heads_info is not None else ()) + self.built_heads
        for name in given:
            method = replace(methods.get(name), files=())  # the heads are not in the target's folder
            available[name] = methods.unavailable_reason(method, self.pair.draft is not None,
                                                         self.target.supports_tree, None)
        return available

    def use_heads(self, path_or_id) -> str:
        """Draft with the published heads in this folder (or cached Hub id) instead of the target's own: the
        layout is detected from its config.json and the heads loaded and checked against the target now
        (a misfit is refused before anything is allocated). Returns the description (layout, the target it
        was trained for, tapped layers, draft vocabulary)."""
        from engine.methods import public_heads

        info = public_heads.detect(path_or_id)
        head = self._load_public(info)
        self.heads_info = info
        self._medusa = head if info.method == "medusa" else None
        self._eagle = head if info.method == "eagle" else None
        self._eagle3 = head if info.method == "eagle3" else None
        self.set_cuda_graphs(self.cuda_graphs)  # the head's runner follows the CUDA-graph setting
        return info.describe()

    def use_built_heads(self, heads: dict) -> None:
        """Draft with ready head objects instead of the target's own: method (eagle, eagle3 or medusa) -> its
        head (an EagleHead, or MedusaHeads), e.g. the random-weight heads of a synthetic pair
        (engine.methods.synthetic_heads). Their methods become available (medusa: medusa-fixed too)."""
        unknown = sorted(set(heads) - {"eagle", "eagle3", "medusa"})
        if unknown:
            raise SpecplayError(f"no head method {unknown[0]!r} (eagle, eagle3, medusa)")
        self._eagle = heads.get("eagle", self._eagle)
        self._eagle3 = heads.get("eagle3", self._eagle3)
        self._medusa = heads.get("medusa", self._medusa)
        runs = {"medusa": ("medusa", "medusa-fixed")}
        added = tuple(name for method in heads for name in runs.get(method, (method,)))
        self.built_heads = tuple(dict.fromkeys(self.built_heads + added))
        self.set_cuda_graphs(self.cuda_graphs)

    def _load_public(self, info):
        if info.method == "medusa":
            from engine.methods.medusa import public as medusa_public

            return medusa_public.load(info, self.target)
        if not self.target.supports_tree:
            raise SpecplayError(f"{info.layout} heads need a Llama-family target")
        if info.method == "eagle":
            from engine.methods.eagle.public import PublicEagleHead

            return PublicEagleHead.load(info, self.target)
        from engine.methods.eagle3.public import PublicEagle3Head

        return PublicEagle3Head.load(info, self.target)

    def medusa_heads(self):
        """The Medusa heads (opened with use_heads, else the target's own), loaded on first use."""
        if self._medusa is None:
            from engine.methods.medusa.drafter import MedusaHeads

            self._medusa = MedusaHeads.load(self.pair.target_name, self.device, self.target.dtype)
        return self._medusa

    def eagle_head(self):
        """The EAGLE head (opened with use_heads, else the target's own), loaded on first use (its runner
        follows the CUDA-graph setting)."""
        if self._eagle is None:
            from engine.methods.eagle.drafter import EagleHead

            self._eagle = EagleHead.load(self.pair.target_name, self.target)
            self.set_cuda_graphs(self.cuda_graphs)
        return self._eagle

    def eagle3_head(self):
        """The EAGLE-3 head (opened with use_heads, else the target's own), loaded on first use (its runner
        follows the CUDA-graph setting)."""
        if self._eagle3 is None:
            from engine.methods.eagle3.drafter import Eagle3Head, own_published_head

            published = own_published_head(self.pair.target_name)
            if published is not None:  # the target's folder holds a published-layout head (eagle3/)
                from engine.methods import public_heads

                self._eagle3 = self._load_public(public_heads.detect(published))
            else:
                self._eagle3 = Eagle3Head.load(self.pair.target_name, self.target)
            self.set_cuda_graphs(self.cuda_graphs)
        return self._eagle3

    def ngram_table(self):
        """The target's corpus table on the device (engine.methods.ngram.corpus_table), or None where it ships
        none; read on first use."""
        if self._ngram_table is False:
            from engine.methods.ngram import corpus_table

            table = corpus_table.load(self.pair.target_name)
            self._ngram_table = None if table is None else table.to(self.device)
        return self._ngram_table

    def suffix_memory(self):
        """The session's suffix-decoding memory (earlier prompts and outputs, a corpus), made on first use."""
        if self._suffix_memory is None:
            from engine.methods.suffix.drafter import SuffixMemory

            self._suffix_memory = SuffixMemory()
        return self._suffix_memory

    def session_state(self):
        """A checkpoint of what the session remembers (suffix decoding's memory), for restore_session."""
        return None if self._suffix_memory is None else self._suffix_memory.checkpoint()

    def restore_session(self, state) -> None:
        """Forget what generations since session_state() added: measurement runs (calibration, sweeps, the
        lossless check) are no one's history, and each measured setting must start where the session was."""
        if state is None:
            self._suffix_memory = None
        else:
            self._suffix_memory.restore(state)

    def available_methods(self) -> tuple:
        return tuple(m for m, reason in self.method_availability().items() if reason is None)

    def generate(self, prompt: str, config: GenerationConfig,
                 should_stop: Optional[Callable[[], bool]] = None) -> Iterator[RoundEvent]:
        """Decode prompt with config; yields one RoundEvent per round. should_stop is polled once a round."""
        config.validate()
        reason = self.method_availability()[config.method]
        if reason is not None:
            raise SpecplayError(f"method {config.method!r} is not available: {reason}")
        prompt_ids = self._encode(prompt)
        self._check_length(len(prompt_ids), config)
        state = DecodeState(tokens=list(prompt_ids), prompt_len=len(prompt_ids), config=config,
                            generator=torch.Generator().manual_seed(config.seed), backend=self.backend,
                            vocab_size=self.vocab_size, device=self.device)
        drafter = methods.get(config.method).build(self, config)
        with torch.inference_mode():
            if self.device.type == "cuda":
                self._calls = stream_calls(self._calls, torch.cuda.current_stream(self.device))
            self._prefill(state, drafter)
            yield from self._rounds(state, drafter, config, should_stop)

    def generate_ids(self, prompt: str, config: GenerationConfig) -> list:
        """Convenience: the generated token ids only."""
        ids = []
        for event in self.generate(prompt, config):
            ids.extend(event.emitted_ids)
        return ids

    def calibrate(self, k: int = 4, repeats: int = 5, methods_to_time=None,
                  prompt: str = "def merge(a, b):\n    ", sampling=None) -> Calibration:
        """Measure the cost model on this machine (engine.analysis.costmodel): the verification curve over
        block sizes,
        each available method's draft and overhead terms, with warm-ups and repeats (median and spread), for
        `sampling` (SamplingParams; default greedy)."""
        from engine.analysis.costmodel import calibrate_costs

        available = self.available_methods()
        chosen = [m for m in (methods_to_time or available) if m in available and m != "none"]
        session = self.session_state()
        try:
            costs = calibrate_costs(self, prompt, chosen, k=k, repeats=repeats, sampling=sampling)
        finally:
            self.restore_session(session)  # calibration's generations are not the session's
        draft_ms = costs.t_draft("draft", 1) if "draft" in chosen else 0.0
        return Calibration(target_step_ms=costs.t_plain, draft_step_ms=draft_ms, costs=costs)

    def verify_curve(self, prompt: str, sizes, warmup: int = 2, repeats: int = 15) -> dict:
        """The verification phase as a round runs it (one target forward over the block, then the greedy
        verification kernel) for each block size in sizes, after the prompt: {size: Measured ms}, timed
        round-robin (engine.analysis.costmodel.round_robin_curve). The cache is rolled back after each
        block."""
        from engine.analysis.costmodel import round_robin_curve

        config = GenerationConfig(method="none", k=1)
        ids = self._encode(prompt)
        sizes = [n for n in sizes if len(ids) + n <= self.target.max_length]
        state = DecodeState(tokens=list(ids), prompt_len=len(ids), config=config,
                            generator=torch.Generator().manual_seed(0), backend=self.backend,
                            vocab_size=self.vocab_size, device=self.device)
        filler = to_device((ids * (1 + max(sizes) // len(ids)))[:max(sizes)], self.device)

        def time_block(n: int) -> float:
            watch = Stopwatch(self.device)
            self._verify(state, Draft(tokens=filler[:n - 1]), config)
            elapsed = watch.elapsed_ms()
            self.target.rollback(start)
            return elapsed

        with torch.inference_mode():
            self.target.reset()
            if len(ids) > 1:
                self.target.forward(to_device(ids[:-1], self.device))
            start = self.target.length
            curve = round_robin_curve(time_block, sizes, warmup, repeats)
            self.target.reset()
        return curve

    def prompt_ids(self, prompt: str) -> list:
        """The prompt's token ids as generate() reads them (a trace header records them, so that a
        prediction can replay a lookup drafter on the very context it had)."""
        return self._encode(prompt)

    # ------------------------------------------------------------------------------------------ internals
    def _encode(self, prompt: str) -> list:
        if not prompt or not prompt.strip():
            raise SpecplayError("the prompt is empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise SpecplayError("the prompt encodes to no tokens")
        vocab = self.target.vocab_size
        beyond = sorted({i for i in ids if i >= vocab})
        if beyond:  # a tokenizer may add tokens past the model's rows (Qwen2's <|endoftext|>, say)
            raise SpecplayError(f"the prompt has token id {beyond[0]}, past the target's {vocab} "
                                f"embedding rows (a special token the model cannot read?)")
        return ids

    def _check_length(self, prompt_len: int, config: GenerationConfig) -> None:
        needed = prompt_len + config.max_new_tokens + config.k + 2
        limit = self.target.max_length
        if self.pair.draft is not None and methods.get(config.method).needs_draft_model:
            limit = min(limit, self.pair.draft.max_length)
        if needed > limit:
            raise SpecplayError(f"prompt ({prompt_len} tokens) + max-new-tokens ({config.max_new_tokens}) "
                                f"+ K exceeds the model's context of {limit} tokens")

    def _prefill(self, state: DecodeState, drafter: Drafter) -> None:
        """Fill the target's cache with the prompt but its last token (fed first by the first round)."""
        self.target.reset()
        self._set_taps(drafter.needs.tap_layers)
        prefix = state.tokens[:-1]
        features = None
        if prefix:
            out = self.target.forward(torch.tensor(prefix, dtype=torch.long, device=self.device))
            features = _features(out) if drafter.needs.prefill_features else None  # [P-1, H]
        drafter.start(state, DraftStart(prompt=list(state.tokens), prefill_features=features))

    def _set_taps(self, layers: tuple) -> None:
        """Tap the target's layers a drafter reads (EAGLE-3), or none (every other method)."""
        layers = tuple(layers)
        if hasattr(self.target, "tap_layers"):
            self.target.tap_layers = layers
        elif layers:
            raise SpecplayError("this drafter reads the target's inner layers: it needs the compact "
                                "Llama-family runner (engine.models.llama)")

    def _rounds(self, state, drafter, config, should_stop) -> Iterator[RoundEvent]:
        """Rounds. On the GPU they are pipelined by one: as soon as a round's outcome is known and the caches
        are rolled back, the next round is queued on the device, and only then is the finished round's event
        built and yielded, so that the host's event work (and the consumer's) overlaps the GPU's next round.
        The events are the same. On the CPU work is synchronous, nothing would overlap, and rounds run one
        after another."""
        metrics = MetricsAccumulator(config.drafts)
        generated: list = []
        text = IncrementalText(self.tokenizer)
        round_index = 0

        def stopped() -> bool:
            return should_stop is not None and should_stop()

        if stopped():
            return
        # Two rounds in flight where the next round's input can come from the device: plain decoding (its
        # next input is the last round's next token, and it never rolls a cache back) and drafters whose
        # round graph reads the last outcome there (Drafter.replays_rounds: Medusa). Not under a synthetic
        # profile: a round queued behind an unread one reads the device's verdict, which the profile overrides
        synthetic = _synthetic_sampler(config)
        ahead = self.pipelined and synthetic is None and (isinstance(drafter, NoDrafter)
                                                          or self._queues_after(drafter))
        inflight = deque([self._launch_round(state, drafter, config)])
        last_end = None
        while True:
            if self.pipelined and round_index > 0 and stopped():  # rounds queued before the stop are dropped
                return
            if ahead and len(inflight) == 1 and len(generated) + 1 < config.max_new_tokens:
                successor = self._launch_after(state, drafter, config, inflight[-1])
                if successor is not None:
                    inflight.append(successor)
            launched = inflight.popleft()
            round_ = self._read_round(launched)  # the one wait for the GPU
            if synthetic is not None:
                round_ = synthetic_verdict(round_, launched.draft, synthetic)
            outcome = self._accept(state, round_.draft_tokens, round_.path, round_.next_token, len(generated),
                                   config)
            self._commit(state, drafter, launched, round_, outcome)
            last_end = launched.clock.stop(since=last_end)
            go_on = outcome.finish_reason is None
            if go_on and self.pipelined and not inflight:
                inflight.append(self._launch_round(state, drafter, config))
            position = len(generated)
            generated.extend(outcome.emitted)
            emitted_text = text.add(outcome.emitted, final=outcome.finish_reason is not None)
            yield self._event(round_index, launched, round_, outcome, position, emitted_text, metrics, config)
            if not go_on:
                return
            if not inflight:  # the synchronous loop (CPU)
                if stopped():
                    return
                inflight.append(self._launch_round(state, drafter, config))
            round_index += 1

    def _launch_round(self, state: DecodeState, drafter: Drafter, config: GenerationConfig,
                      first_token: Optional[torch.Tensor] = None) -> "_Launched":
        """Queue a round's drafting and verification; nothing here waits for the device. first_token: the
        block's first token [1] on the device when the host does not know it yet (plain decoding ahead)."""
        clock = RoundClock(self.device, self._calls)
        draft = drafter.propose(state, config.k)
        clock.mark()  # drafting queued
        block_start = self.target.length  # the cache row of the last committed token, fed first
        graph = self._host_tree_graph(state, drafter, draft, config, first_token)
        if graph is not None:
            logits, features, result, uniforms, readout = self._host_tree_round(state, draft, graph,
                                                                                 block_start)
        else:
            draft = _tokens_on(draft, self.device)
            logits, features, result, uniforms = self._verify(state, draft, config, first_token)
            readout = self._queue_readout(draft, result, logits, config)
        if self.pipelined:
            drafter.verified(state, features)
        clock.mark()  # verification queued
        return _Launched(clock, draft, block_start, logits, features, result, uniforms, readout,
                         compacted=graph is not None)

    def _host_tree_graph(self, state, drafter: Drafter, draft: Draft, config, first_token):
        """The captured verification for a tree drafted on the host, or an empty draft of such a drafter
        (HostTreeRoundGraph), or None where the round is queued op by op: another drafter, one that reads the
        block's features or logits (the graph's outputs are overwritten by its next replay), or no graph
        for this target and block."""
        needs = drafter.needs
        on_host = draft.parents.device.type == "cpu" if draft.is_tree else draft.size == 0
        if not (self.pipelined and first_token is None and drafter.drafts_on_host and not config.synthetic
                and on_host and draft.tree_block is None and draft.probs is None
                and not (needs.block_features or needs.block_logits)):
            return None
        sampling = config.sampling
        warp = None if sampling.greedy else (sampling.temperature, sampling.top_k, sampling.top_p)
        return host_tree_round_graph(self.target, draft.size, state.backend,
                                     min(TOP_ALTERNATIVES, self.vocab_size), warp)

    def _host_tree_round(self, state, draft: Draft, graph, block_start: int):
        """A host tree's verification as one upload and one replay; returns what _verify and _queue_readout
        do. The uniforms are drawn where _verify draws them, so a seeded run's output is the same."""
        uniforms = None
        if not state.config.sampling.greedy:
            uniforms = torch.rand(draft.size + 1, generator=state.generator)  # the event's copy
        parents = draft.parents.tolist() if draft.is_tree else []
        graph.upload(self._calls, block_start, state.tokens[-1], draft.tokens.tolist(), parents, uniforms)
        graph.replay(self._calls)
        self.target.occupy(block_start, graph.rows)
        readout = self._copy_readout(graph.values, graph.width, draft)
        return graph.logits, graph.features, graph.result, uniforms, readout

    def _queues_after(self, drafter: Drafter) -> bool:
        """Whether a round of this drafter (plain decoding's step included) may be a round graph's replay."""
        replays = isinstance(drafter, NoDrafter) or drafter.replays_rounds
        return replays and getattr(self.target, "takes_device_starts", False)

    def _launch_after(self, state, drafter, config, previous: _Launched) -> Optional[_Launched]:
        """The round after `previous`, queued before `previous` is read: plain decoding's from its next token
        on the device, a drafter's as one replay of its round graph. None (the round is launched once
        `previous` is read) when the drafter has no graph here or the cache might not hold the block."""
        width = min(TOP_ALTERNATIVES, self.vocab_size)
        graph = self._round_graph(state, drafter, config, width)
        if graph is not None:
            return self._replay_round(state, drafter, graph, previous, width)
        if isinstance(drafter, NoDrafter):
            return self._launch_round(state, drafter, config, previous.next_token_on_device)
        return None

    def _round_graph(self, state, drafter, config, width: int):
        """The captured round to replay behind an unread one: plain decoding's step, or the drafter's round
        graph; None where there is none."""
        if not self._queues_after(drafter):
            return None
        if isinstance(drafter, NoDrafter):
            return plain_round_graph(self.target, state.backend, width, chain_sampling(state))
        return drafter.round_graph(state, config, width)

    def _replay_round(self, state, drafter: Drafter, graph, previous: _Launched, width: int
                      ) -> Optional[_Launched]:
        """The round after `previous` as one replay of the drafter's round graph (engine.core.graphs),
        which
        reads `previous`'s outcome on the device: seeded from it first when `previous` ran apart. A sampled
        round's uniforms are drawn here, where _verify draws them, and copied in. A chain's drafting is a
        graph of its own, replayed first: the clock times it as the draft phase. Medusa's heads draft at the
        end of its round's graph, so its draft phase is empty and its verification phase holds them."""
        fed = graph.fed_by is previous
        unread_tree = previous.draft.is_tree and previous.draft.parents.device.type != "cpu"
        # the longest path the last round can have accepted (a device tree's shape is not read yet: its bound)
        latest = previous.block_start + 1 + (graph.depth if fed or unread_tree else _depth(previous.draft))
        if latest + graph.rows > self.target.max_length:
            return None
        clock = RoundClock(self.device, self._calls)
        if not fed:
            graph.seed(previous, drafter)
        uniforms = None if state.config.sampling.greedy else graph.draw_uniforms(state)  # [N+1] host
        graph.replay_draft(self._calls)
        clock.mark()
        self.target.rollback(latest)
        graph.replay(self._calls)
        self.target.occupy(latest, graph.rows)
        drafter.replayed(graph)
        draft = Draft(tokens=graph.tokens[1:], parents=graph.parents)
        readout = self._copy_readout(graph.values, width, draft)
        clock.mark(readout.copied)  # the copy's event, recorded last, ends the verification phase
        launched = _Launched(clock, draft, latest, graph.logits, graph.features, graph.result, uniforms,
                             readout, counted=graph.counts_drafts)
        previous.successor = graph.fed_by = launched
        return launched

    def _commit(self, state, drafter: Drafter, launched: "_Launched", round_, outcome) -> None:
        """Roll the target's cache back to the accepted path and tell the drafter what it needs."""
        successor = launched.successor
        if successor is None and (launched.counted or launched.compacted):
            # its block's rows were written whole (K+1 of them, drafts or not), or its graph kept the path
            self.target.rollback(launched.block_start + 1 + outcome.accepted)
        elif successor is None:
            self._roll_back(launched.draft, outcome, launched.block_start)
        else:  # the successor's replay rolled this block back on the device; its block follows the path
            successor.block_start = launched.block_start + 1 + outcome.accepted
            end = successor.block_start + (0 if outcome.finish_reason else successor.draft.size + 1)
            self.target.rollback(end)
        needs = drafter.needs
        drafter.commit(state, RoundCommit(
            accepted=outcome.accepted, accepted_rows=[0] + [i + 1 for i in outcome.path],
            draft_tokens=round_.draft_tokens,
            block_features=launched.features if needs.block_features else None,
            block_logits=launched.logits if needs.block_logits else None,
            block_argmax=[row[0] for row in round_.top_i] if needs.block_argmax else None,
            fed_ahead=successor is not None))

    def _event(self, index, launched, round_, outcome, position, emitted_text, metrics, config) -> RoundEvent:
        draft = launched.draft
        details = self._details(draft, round_, launched.uniforms, outcome)
        # the readout's copy waited for the events
        draft_ms, verify_ms, overhead_ms = launched.clock.phases_ms()
        round_metrics = metrics.add_round(draft.size, outcome.accepted, len(outcome.emitted),
                                          details["positions"],
                                          draft_ms, verify_ms, overhead_ms)
        return RoundEvent(
            round=index, method=config.method, k=config.k, drafted=details["drafted"],
            accepted_count=outcome.accepted, next_token_id=outcome.next_token,
            next_token_text=self._token_text(outcome.next_token),
            next_is_bonus=outcome.accepted == draft.size,
            next_token_p=details["next_p"], next_top=details["next_top"], emitted_ids=list(outcome.emitted),
            emitted_text=emitted_text, position=position, draft_ms=draft_ms, verify_ms=verify_ms,
            overhead_ms=overhead_ms, finished=outcome.finish_reason is not None,
            finish_reason=outcome.finish_reason, metrics=round_metrics,
            verified_tokens=config.k + 1 if launched.counted else draft.size + 1,
            synthetic_acceptance=config.synthetic_acceptance if config.drafts else "")

    def _verify(self, state: DecodeState, draft: Draft, config: GenerationConfig,
                first_token: Optional[torch.Tensor] = None):
        """One target forward over [last committed token] + draft, then the verification kernel.
        Returns (logits [N+1, V], features [N+1, H], VerifyResult, uniforms or None)."""
        last = first_token if first_token is not None else to_device(state.tokens[-1:], self.device)
        block = torch.cat([last, draft.tokens])  # [N+1]
        if draft.tree_block is not None:  # a tree drafted on the device
            out = self.target.forward(block, tree=draft.tree_block)
        elif draft.is_tree:
            out = self.target.forward(block, torch.cat([torch.tensor([-1]), draft.parents + 1]))  # host
        else:
            out = self.target.forward(block)
        logits = out.logits  # [N+1, V]: the target's full distribution, never narrowed to the draft's
        if not self.backend.flags_nan_on_device and torch.isnan(logits).any():
            raise SpecplayError(NAN_MESSAGE)
        sampling, backend, tokens = config.sampling, self.backend, draft.tokens[None]  # tokens [1, N]
        if sampling.greedy:
            result = (backend.verify_tree_greedy(logits[None], tokens, draft.parents) if draft.is_tree
                      else backend.verify_chain_greedy(logits[None], tokens))
            return logits, _features(out), result, None
        uniforms = torch.rand(draft.size + 1, generator=state.generator)  # CPU copy kept for the event
        device_uniforms = to_device(uniforms, self.device, torch.float32)[None]  # [1, N+1]
        probs = draft.probs[None] if draft.probs is not None else None  # [1, N, V] or one-hot
        warp = (sampling.temperature, sampling.top_k, sampling.top_p)
        if draft.is_tree:
            result = backend.verify_tree_stochastic(logits[None], tokens, draft.parents, probs,
                                                    device_uniforms, *warp)
        else:
            result = backend.verify_chain_stochastic(logits[None], tokens, probs, device_uniforms, *warp)
        return logits, _features(out), result, uniforms

    def _accept(self, state, draft_tokens: list, path, next_token, generated_len, config) -> _RoundOutcome:
        emitted = [draft_tokens[i] for i in path] + [next_token]
        finish = None
        for i, token in enumerate(emitted):
            if config.stop_at_eos and token in self.eos_ids:
                emitted, finish = emitted[:i + 1], "eos"
                break
        budget = config.max_new_tokens - generated_len
        if len(emitted) >= budget:
            emitted, finish = emitted[:budget], finish or "length"
        state.tokens.extend(emitted)
        return _RoundOutcome(accepted=len(path), next_token=next_token, path=path, emitted=emitted,
                             finish_reason=finish)

    def _roll_back(self, draft: Draft, outcome: _RoundOutcome, start: int) -> None:
        """Keep the last committed token and the accepted path in the target cache; the next token stays
        out."""
        if draft.is_tree and outcome.path != list(range(len(outcome.path))):
            keep = to_device([0] + [i + 1 for i in outcome.path], self.device)
            self.target.compact(start, keep)
        elif draft.size:  # an empty draft's block is kept whole (and a plain round queued after it stays)
            # a chain, or a tree whose path is its first rows: they are in place
            self.target.rollback(start + 1 + outcome.accepted)

    def _queue_readout(self, draft: Draft, result, logits, config) -> _QueuedReadout:
        """Everything the host needs from the round, gathered on the device by the backend's readout (one
        kernel on CUDA) and copied to pinned host memory right behind the verification: the verdict
        (accepted count, next token, path), the draft's tokens, the per-token figures of the event (p, q,
        min(1, p/q), tested, p of the next token, the target's top alternatives per row), and a device tree's
        parents. Queued now, not when the round is read: by then plain decoding has queued its next round,
        and a copy behind it would wait for that round too."""
        sampling = config.sampling
        temperature = 1.0 if sampling.greedy else sampling.temperature
        width = min(TOP_ALTERNATIVES, logits.shape[-1])
        return self._copy_readout(self.backend.readout(logits, result, draft.tokens, temperature, width),
                                  width, draft)

    def _copy_readout(self, values: torch.Tensor, width: int, draft: Draft) -> _QueuedReadout:
        """The readout's values (width top alternatives per row; a device tree's parents) queued for pinned
        host memory."""
        if values.device.type == "cpu":
            return _QueuedReadout(values, width, None, None)
        parents = None
        if draft.is_tree and draft.parents.device.type != "cpu":
            parents = self._pinned.take(draft.parents.shape, torch.long)
            self._calls.copy_to_host(parents, draft.parents)
        host = self._pinned.take(values.shape, values.dtype)
        self._calls.copy_to_host(host, values)
        return _QueuedReadout(host, width, parents, self._calls.event())

    def _read_round(self, launched: _Launched) -> "_RoundReadout":
        """Wait for the round's readout (the round's one wait for the GPU) and unpack it."""
        values = launched.readout.wait()
        if launched.readout.parents is not None:  # the device tree's shape, for the rollback and the event
            launched.draft.parents = launched.readout.parents
        if not launched.counted:
            return _RoundReadout.unpack(values, launched.draft.size, launched.readout.width)
        count = int(values[-1])  # the chain's real drafts (after the values)
        round_ = _RoundReadout.unpack(values, launched.draft.size, launched.readout.width, keep=count)
        launched.draft = Draft(tokens=launched.draft.tokens[:count])
        return round_

    def _details(self, draft: Draft, round_: "_RoundReadout", uniforms, outcome) -> dict:
        """The event's DraftedTokens, the next token's figures and the draft's depth (positions), from the
        round's readout. A block row's top alternatives are listed once, for every token drafted from it."""
        n = draft.size
        parents = draft.parents.tolist() if draft.is_tree else range(-1, n - 1)
        on_path = set(outcome.path)
        text = self._token_text
        listed: dict = {}  # block row -> [(text, p)]

        def top(row: int) -> list:
            alternatives = listed.get(row)
            if alternatives is None:
                pairs = zip(round_.top_p[row], round_.top_i[row])
                alternatives = listed[row] = [(text(i), p) for p, i in pairs]
            return alternatives

        drafted, depths = [], []
        p, q, accept_prob, tested = round_.p, round_.q, round_.accept_prob, round_.tested
        for i, (token, parent) in enumerate(zip(round_.draft_tokens, parents)):
            depth = 0 if parent < 0 else depths[parent] + 1
            depths.append(depth)
            was_tested = bool(tested[i])
            drafted.append(DraftedToken(
                token, text(token), parent, depth, p[i], q[i], accept_prob[i],
                None if uniforms is None or not was_tested else float(uniforms[i]), i in on_path, was_tested,
                top(parent + 1)))
        next_row = outcome.path[-1] + 1 if outcome.path else 0
        return {"drafted": drafted, "next_p": round_.next_p, "next_top": top(next_row),
                "positions": 1 + max(depths, default=-1)}

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            self._token_texts[token] = text
        return text



def _synthetic_sampler(config: GenerationConfig):
    """The generation's synthetic verdicts (engine.core.synthetic), or None under real verification."""
    profile = profile_of(config)
    return None if profile is None else profile.sampler(config.k, config.seed)


def synthetic_verdict(round_: _RoundReadout, draft: Draft, sampler) -> _RoundReadout:
    """The round's readout with the verdict a synthetic profile draws in place of the device's: the first
    `a` positions of the draft accepted (a tree: a path of that depth, the device's own path as far as it
    fits), the target's most likely token at the row after them as the next token. The verification ran
    as usual; its figures (p, q, the target's alternatives) stay the device's."""
    n = len(round_.draft_tokens)
    parents = draft.parents.tolist() if draft.is_tree else list(range(-1, n - 1))
    children: dict = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    height = _subtree_heights(parents, children)
    wanted = sampler.accepted([height.get(-1, 0)])[0]
    device_path, path, node = set(round_.path), [], -1
    while len(path) < wanted:
        deep_enough = [c for c in children[node] if height[c] >= wanted - len(path)]
        node = next((c for c in deep_enough if c in device_path), deep_enough[0])
        path.append(node)
    on_path = {-1, *path}
    row = path[-1] + 1 if path else 0
    return replace(round_, path=path, next_token=round_.top_i[row][0], next_p=round_.top_p[row][0],
                   tested=[1.0 if parent in on_path else 0.0 for parent in parents])


def _subtree_heights(parents: list, children: dict) -> dict:
    """node -> the longest chain of nodes from it down (itself included); -1 (the root): the draft's
    depth."""
    height: dict = {}
    for node in reversed(range(len(parents))):  # children come after their parents (topological order)
        height[node] = 1 + max((height[c] for c in children.get(node, ())), default=0)
    height[-1] = max((height[c] for c in children.get(-1, ())), default=0)
    return height


class PinnedRing:
    """Pinned host buffers for the readouts' copies, RING per shape, handed out in turn: a buffer comes back
    RING rounds after its round, which was read (wait() turns it into a list) long before, since at most two
    rounds are in flight. A fresh pinned buffer costs the host about 2.5 us
    (docs/measurements/host_cost_gpu.txt); one reused costs nothing."""

    RING = 4

    def __init__(self):
        self._rings: dict = {}  # (shape, dtype) -> [buffers, next index]

    def take(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [[torch.empty(shape, dtype=dtype, pin_memory=True)
                                        for _ in range(self.RING)], 0]
        buffers, index = ring
        ring[1] = (index + 1) % self.RING
        return buffers[index]


def _tokens_on(draft: Draft, device: torch.device) -> Draft:
    """The draft with its tokens on the device (a host drafter may leave them on the host, see Draft)."""
    if draft.tokens.device.type != "cpu" or torch.device(device).type == "cpu":
        return draft
    return replace(draft, tokens=to_device(draft.tokens, device))


def _depth(draft: Draft) -> int:
    """The longest path a draft can have accepted: its tree's depth, or its chain's length."""
    if not draft.is_tree:
        return draft.size
    depths: list = []
    for parent in draft.parents.tolist():
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return 1 + max(depths, default=-1)


def attention_without_plans() -> None:
    """Keep SDPA off its cuDNN backend: in bf16 it builds a plan for every new prompt length (48-95 ms on the
    first prefill of each length, measured on an H200), where the memory-efficient kernel costs what the
    forward costs. Process-wide, which is what a playground that owns its process wants."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def eos_ids(tokenizer) -> set:
    """The ids that end a generation (the tokenizer's EOS, when it has one)."""
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _features(out) -> torch.Tensor:
    """What a drafter gets as the target's features: the tap layers' outputs when the runner taps any
    (EAGLE-3), else the last layer's."""
    taps = getattr(out, "taps", None)
    return out.hidden if taps is None else taps
