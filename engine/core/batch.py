"""Batched speculative decoding: B prompts of different lengths, one target forward verifies B blocks of K+1.

Acceptance is ragged: each sequence accepts its own count, rolls back its own cache rows and finishes on its
own EOS or budget. A finished sequence stays in the batch as padding (its block is computed and thrown away)
and stops counting in the figures. Plain decoding ("none") is the same loop with empty drafts, so both sides
of every comparison are measured alike.

Ragged drafts (n-gram proposals of different lengths; EAGLE's one-token prompts, which draft nothing in
their first round) are right-padded to the round's longest one. The verification kernels take one N per call,
so padded positions are made impossible to accept: the logits get one extra column at -inf (p = 0 at every
row, the other columns' warped distribution unchanged) and a padded draft is that column's token, with one-hot
q on it. Greedy: the pad never equals the argmax, so verification stops at the first pad and the next token is
the argmax of row n_b, the bonus row. Sampling: the pad's acceptance probability is min(1, 0/1) = 0, and the
residual normalize(max(p - e_pad, 0)) is p itself, so the next token is drawn from row n_b's distribution,
again the bonus. Every real position is tested exactly as without padding (causal attention keeps the pads out
of rows 0..n_b). See tests/test_batch.py for the check."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from engine.config import GenerationConfig
from engine.core.decoder import attention_without_plans, eos_ids
from engine.core.synthetic import profile_of
from engine.errors import SpecplayError
from engine.kernels import REFERENCE, select_backend
from engine.methods import registry as methods
from engine.methods.batch_base import BatchDraft, BatchDrafter, BatchSequence, prefill_batch
from engine.models.batch_runner import BatchRunner
from engine.models.runner import to_device
from engine.tuning import ENVIRONMENT, Tuning


# ------------------------------------------------------------------------------------------------ results
@dataclass
class SequenceResult:
    index: int
    prompt_len: int
    ids: list = field(default_factory=list)  # generated token ids
    text: str = ""
    finish_reason: Optional[str] = None
    rounds: int = 0  # rounds in which this sequence was still decoding
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_round(self) -> float:
        return len(self.ids) / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {"index": self.index, "prompt_tokens": self.prompt_len, "text": self.text,
                "tokens": len(self.ids), "finish_reason": self.finish_reason, "rounds": self.rounds,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_round": self.tokens_per_round}


@dataclass
class BatchResult:
    sequences: List[SequenceResult]
    method: str
    k: int
    rounds: int = 0  # target forwards after the prefill (one per round, the whole batch)
    seconds: float = 0.0  # decoding rounds, wall clock (the prefill apart)
    prefill_ms: float = 0.0
    device: str = "CPU"
    outcomes: dict = field(default_factory=dict)  # (drafted, accepted) -> sequence-rounds that ended so
    groups: int = 1  # batches run one after another whose sequences this holds (merged_results)
    synthetic_acceptance: str = ""  # the synthetic profile the verdicts followed ("" = the target's own)

    @property
    def per_position_acceptance(self) -> list:
        """alpha_i: P(draft i accepted | drafts 0..i-1 accepted), over every sequence and round. A round that
        drafted n and accepted a tested depths 0..min(a, n-1) and accepted depths 0..a-1."""
        tested, accepted = [0] * self.k, [0] * self.k
        for (drafted, acc), times in self.outcomes.items():
            for depth in range(min(drafted, acc + 1, self.k)):
                tested[depth] += times
                accepted[depth] += times * (depth < acc)
        return [a / t if t else 0.0 for a, t in zip(accepted, tested, strict=True)]

    @property
    def batch(self) -> int:
        """Sequences per forward."""
        return len(self.sequences) // self.groups

    @property
    def tokens(self) -> int:
        return sum(len(s.ids) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens per sequence per round, counting finished sequences' padded rounds as idle (what a static
        batch pays for); 1 for plain decoding with equal budgets."""
        return self.tokens / (self.rounds * self.batch) if self.rounds else 0.0

    def summary(self) -> dict:
        drafted = sum(s.drafted for s in self.sequences)
        accepted = sum(s.accepted for s in self.sequences)
        return {"method": self.method, "k": self.k, "batch": self.batch, "rounds": self.rounds,
                "tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "prefill_ms": self.prefill_ms, "tokens_per_round": self.tokens_per_round,
                "drafted": drafted, "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "per_position_acceptance": self.per_position_acceptance, "device": self.device,
                "synthetic_acceptance": self.synthetic_acceptance}


def merged_results(results: Sequence[BatchResult]) -> BatchResult:
    """Batches of the same size and configuration run one after another, as one result: their sequences,
    rounds, wall time and acceptance outcomes summed (tokens/s over the whole time, tokens per round per
    sequence over every batch's rounds)."""
    first = results[0]
    outcomes: dict = {}
    for r in results:
        for key, times in r.outcomes.items():
            outcomes[key] = outcomes.get(key, 0) + times
    return BatchResult(sequences=[s for r in results for s in r.sequences], method=first.method, k=first.k,
                       rounds=sum(r.rounds for r in results), seconds=sum(r.seconds for r in results),
                       prefill_ms=sum(r.prefill_ms for r in results), device=first.device, outcomes=outcomes,
                       groups=sum(r.groups for r in results), synthetic_acceptance=first.synthetic_acceptance)


class BatchSampler:
    """The run's randomness and sampling settings (one CPU generator for the whole batch: rows get
    independent uniforms, and a seed reproduces the run)."""

    def __init__(self, config: GenerationConfig, backend, vocab_size: int, device):
        self.config, self.backend, self.vocab_size, self.device = config, backend, vocab_size, device
        self.generator = torch.Generator().manual_seed(config.seed)
        profile = profile_of(config)
        # a synthetic profile's verdicts (engine.core.synthetic; the output is then not the model's), or None
        self.synthetic = None if profile is None else profile.sampler(config.k, config.seed)

    @property
    def greedy(self) -> bool:
        return self.config.sampling.greedy

    def uniforms(self, *shape: int) -> torch.Tensor:
        return to_device(torch.rand(*shape, generator=self.generator), self.device, torch.float32)

    def draw(self, logits: torch.Tensor):
        """One draft token per row of logits [B, V']: (tokens [B], q [B, V] or None when greedy)."""
        logits = logits[:, :self.vocab_size]
        if self.greedy:
            return logits.argmax(-1), None
        s = self.config.sampling
        q = self.backend.warp_probs(logits, s.temperature, s.top_k, s.top_p)  # [B, V]
        return self.backend.sample_from_probs(q, self.uniforms(logits.shape[0])), q


# ------------------------------------------------------------------------------------------------ padding
def pad_for_verify(logits: torch.Tensor, draft: BatchDraft, live: Sequence[bool]):
    """(logits, draft tokens, draft probs) for the verification kernels, with every padded draft position of a
    live sequence impossible to accept (see the module docstring). Unchanged when no live row is ragged.
    logits [B, N+1, V] -> [B, N+1, V] or [B, N+1, V+1]; tokens [B, N]; probs [B, N, V(+1)] or None."""
    n = draft.width
    if all(c == n for c, ok in zip(draft.counts, live, strict=True) if ok):
        return logits, draft.tokens, draft.probs
    bsz, rows, vocab = logits.shape
    device = logits.device
    logits = torch.cat([logits, logits.new_full((bsz, rows, 1), float("-inf"))], dim=-1)  # [B, N+1, V+1]
    padded = (torch.arange(n, device=device)[None, :]
              >= to_device(draft.counts, device)[:, None])  # [B, N] True at pads
    tokens = torch.where(padded, torch.full_like(draft.tokens, vocab), draft.tokens)
    probs = draft.probs
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(bsz, n, 1)], dim=-1)  # [B, N, V+1]
        one_hot = torch.zeros_like(probs)
        one_hot[..., vocab] = 1.0
        probs = torch.where(padded[..., None], one_hot, probs)
    return logits.contiguous(), tokens, probs


# ------------------------------------------------------------------------------------------------ decoder
class BatchDecoder:
    """Decode B prompts as one batch with one of the batched methods (none, draft, ngram, eagle).

    eagle_head: the target's EAGLE head (an EagleHead, or a function returning one, called on first use, e.g.
    a loaded SpeculativeDecoder's eagle_head: the head is then shared); default: loaded from the target's
    directory on first use."""

    def __init__(self, pair, backend=None, eagle_head=None, tuning: Tuning = ENVIRONMENT):
        """tuning: the switches this decoder runs with (engine.tuning; the process's environment by
        default)."""
        self.pair = pair
        self._eagle_head = eagle_head
        self.target = pair.target
        self.tokenizer = pair.tokenizer
        self.device = self.target.device
        self.backend = backend or (select_backend(self.device) if tuning.kernels else REFERENCE)
        self.vocab_size = pair.vocab_size
        self.eos_ids = eos_ids(self.tokenizer)
        self.use_graphs = self.device.type == "cuda" and tuning.graphs
        self.tuning = tuning
        if not tuning.kernels:
            for runner in (self.target, pair.draft):
                if hasattr(runner, "use_torch_twins"):
                    runner.use_torch_twins()
        if self.use_graphs:
            attention_without_plans()  # as the single-sequence decoder: no cuDNN plan per prompt length
        self.target_batch: Optional[BatchRunner] = None
        self.batch_drafters: dict = {}
        if not hasattr(self.target, "layers"):
            raise SpecplayError("batched decoding needs a Llama-family target (the compact forward)")
        if self.device.type == "cuda":
            # as SpeculativeDecoder does: cuDNN's SDPA plans a kernel per new shape (tens of ms each)
            torch.backends.cuda.enable_cudnn_sdp(False)

    def free_caches(self) -> None:
        """Drop the batched caches and graphs (the target's and the drafters'): the next batch allocates
        anew."""
        self.target_batch = None
        self.batch_drafters.clear()

    @property
    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"

    def encode(self, prompt: str) -> list:
        if not prompt or not prompt.strip():
            raise SpecplayError("a prompt is empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise SpecplayError("a prompt encodes to no tokens")
        return ids

    def generate(self, prompts: Sequence, config: GenerationConfig,
                 budgets: Optional[Sequence[int]] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 until_first_done: bool = False, texts: bool = True) -> BatchResult:
        """Decode every prompt (a string, or a list of token ids) of the batch. budgets: max new tokens per
        sequence (default config.max_new_tokens each). should_stop() is polled once a round.

        until_first_done stops once any sequence has finished: every measured round then runs the full batch
        (the steady state a server that refills finished slots sees), not the static batch's ragged tail.
        texts=False leaves SequenceResult.text empty (benchmarks: B x tokens decodes cost seconds)."""
        config.validate()
        if not prompts:
            raise SpecplayError("no prompts to decode")
        if config.method not in methods.BATCH_METHODS:
            raise SpecplayError(f"method {config.method!r} is not batched; choose one of: "
                                f"{', '.join(methods.BATCH_METHODS)}")
        if config.method == "draft" and not hasattr(self.pair.draft, "layers"):
            raise SpecplayError("batched method 'draft' needs a Llama-family draft model")
        if config.method == "eagle":
            if config.tree_nodes:
                raise SpecplayError(f"batched EAGLE drafts a chain of K: method 'eagle', not the tree "
                                    f"'eagle:{config.tree_nodes}'")
            self.eagle_head()  # a pair without a head fails here, before anything is allocated
        seqs = self._sequences(prompts, config, budgets)
        max_length = max(s.prompt_len + s.budget for s in seqs) + config.k + 2
        self._check_length(max_length, config)
        sampler = BatchSampler(config, self.backend, self.vocab_size, self.device)
        result = BatchResult([s.result for s in seqs], config.method, config.k, device=self.device_name,
                             synthetic_acceptance=config.synthetic_acceptance if config.drafts else "")
        with torch.inference_mode():
            target, drafter = self._prepare(len(seqs), max_length, config)
            began = time.perf_counter()
            features = prefill_batch(target, seqs)
            drafter.start(seqs, max_length, features)
            _sync(self.device)
            result.prefill_ms = 1000.0 * (time.perf_counter() - began)
            began = time.perf_counter()
            while not all(s.done for s in seqs):
                if should_stop is not None and should_stop():
                    break
                if until_first_done and any(s.done for s in seqs):
                    break
                self._round(target, drafter, seqs, config, sampler, result)
                result.rounds += 1
            _sync(self.device)
            result.seconds = time.perf_counter() - began
        for s in seqs if texts else ():
            s.result.text = self.tokenizer.decode(s.result.ids, skip_special_tokens=True,
                                                  clean_up_tokenization_spaces=False)
        return result

    def ngram_table(self):
        """The target's corpus table for n-gram (engine.methods.ngram.corpus_table), or None; read once."""
        if not hasattr(self, "_ngram_table"):
            from engine.methods.ngram import corpus_table

            self._ngram_table = corpus_table.load(self.pair.target_name)
        return self._ngram_table

    def eagle_head(self):
        """The target's EAGLE head (see the class docstring); SpecplayError when the target has none."""
        head = self._eagle_head
        try:
            if callable(head):
                head = head()
            if head is None:
                from engine.methods.eagle.drafter import EagleHead

                head = EagleHead.load(self.pair.target_name, self.target)
        except SpecplayError as exc:
            raise SpecplayError(f"batched method 'eagle' needs the target's EAGLE head: {exc}") from None
        if not self.tuning.kernels:
            head.runner.use_torch_twins()
        self._eagle_head = head
        return head

    # -- internals -------------------------------------------------------------------------------------------

    def _sequences(self, prompts, config, budgets) -> List[BatchSequence]:
        budgets = [config.max_new_tokens] * len(prompts) if budgets is None else list(budgets)
        if len(budgets) != len(prompts) or min(budgets) < 1:
            raise SpecplayError("budgets: one positive token budget per prompt")
        seqs = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            if not ids:
                raise SpecplayError(f"prompt {i + 1} has no tokens")
            seqs.append(BatchSequence(list(ids), len(ids), int(budget), SequenceResult(i, len(ids))))
        return seqs

    def _check_length(self, max_length: int, config: GenerationConfig) -> None:
        limit = self.target.max_length
        if config.method == "draft":
            limit = min(limit, self.pair.draft.max_length)
        if max_length > limit:
            raise SpecplayError(f"the longest prompt + max-new-tokens + K needs {max_length} tokens; "
                                f"the model's context is {limit}")

    def _prepare(self, batch: int, max_length: int, config: GenerationConfig):
        """The target's batched runner (kept while B and the context fit) and a drafter for the method."""
        t = self.target_batch
        if t is None or t.batch != batch or t.max_length < max_length:
            self.target_batch = t = None  # free the old cache before allocating the new one
            t = self.target_batch = BatchRunner(self.target, batch, max_length)
        t.use_graphs = self.use_graphs
        t.reset()
        drafter = methods.get(config.method).batch_build(self, config)
        if hasattr(drafter, "use_graphs"):
            drafter.use_graphs = self.use_graphs
        return t, drafter

    def kept_drafter(self, name: str, build: Callable[[], "BatchDrafter"]) -> "BatchDrafter":
        """The batched drafter kept under name across batches (its runner and caches), built on first use."""
        if name not in self.batch_drafters:
            self.batch_drafters[name] = build()
        return self.batch_drafters[name]

    def _round(self, target: BatchRunner, drafter: BatchDrafter, seqs: List[BatchSequence], config, sampler,
               result: BatchResult) -> None:
        """Draft -> one target forward over every block -> verify -> ragged accept, roll back, finish."""
        live = [not s.done for s in seqs]
        draft = drafter.propose(seqs, config.k, sampler)
        last = to_device([s.tokens[-1] for s in seqs], self.device)[:, None]  # [B, 1]
        block = torch.cat([last, draft.tokens], dim=1)  # [B, N+1]
        starts = list(target.lengths)
        counts = [c + 1 if ok else 0 for c, ok in zip(draft.counts, live, strict=True)]
        logits, features = target.forward(block, counts)  # [B, N+1, V], [B, N+1, H]
        verdict = self._verify(logits[..., :self.vocab_size], draft, live, sampler)
        if sampler.synthetic is not None:  # verified as usual; the verdict follows the profile
            verdict = self._synthetic(logits[..., :self.vocab_size], draft.counts, sampler.synthetic)
        values = torch.cat([verdict.accepted[:, None], verdict.next_token[:, None], draft.tokens], dim=1)
        rows = values.tolist()  # the round's one host sync: [B, 2 + N]
        accepted = self._settle(seqs, rows, draft.counts, config, result.outcomes)
        # each cache keeps the last committed token and the accepted drafts. A finished sequence (this round
        # or before) keeps nothing: its later padding blocks then stay inside the cache (the accepted rows of
        # a last round cut short by the budget could reach K rows past it).
        target.lengths = [start if s.done else start + 1 + acc
                          for start, acc, s in zip(starts, accepted, seqs, strict=True)]
        drafter.commit(seqs, accepted, features)

    def _synthetic(self, logits: torch.Tensor, counts: list, synthetic) -> "_Simulated":
        """A synthetic profile's verdict (engine.core.synthetic.AcceptanceSampler, the single-sequence
        decoder's too): each row's accepted count drawn from the profile (at most its drafts), then the
        target's most likely token at the row after them. logits [B, N+1, V]."""
        acc_dev = to_device(synthetic.accepted(counts), logits.device)  # [B]
        rows = torch.arange(len(counts), device=logits.device)
        return _Simulated(acc_dev, logits[rows, acc_dev].argmax(-1))

    def _settle(self, seqs: List[BatchSequence], rows: list, counts: list, config, outcomes: dict) -> list:
        """Each live sequence's accepted count and emitted tokens from the round's readout rows [B][2 + N]
        (accepted, next token, the drafts). One lean pass: at large B this host loop is on the critical
        path."""
        accepted = [0] * len(seqs)
        for b, (s, row) in enumerate(zip(seqs, rows, strict=True)):
            if s.done:
                continue
            acc, next_token = row[0], row[1]
            if acc < 0 or next_token < 0:  # the CUDA kernels flag NaN logits with -1 (no extra sync)
                raise SpecplayError("the target model produced NaN logits (a numerical overflow? "
                                    "try --dtype float32)")
            acc = min(acc, counts[b])  # the padding already makes acc <= counts
            accepted[b] = acc
            key = (counts[b], acc)
            outcomes[key] = outcomes.get(key, 0) + 1
            emitted = row[2:2 + acc]
            emitted.append(next_token)
            self._accept(s, emitted, counts[b], acc, config)
        return accepted

    def _verify(self, logits: torch.Tensor, draft: BatchDraft, live, sampler):
        logits, tokens, probs = pad_for_verify(logits, draft, live)
        try:
            if sampler.greedy:
                return self.backend.verify_chain_greedy(logits, tokens)
            s = sampler.config.sampling
            uniforms = sampler.uniforms(logits.shape[0], logits.shape[1])  # [B, N+1]
            return self.backend.verify_chain_stochastic(logits, tokens, probs, uniforms, s.temperature,
                                                        s.top_k, s.top_p)
        except ValueError as exc:  # the reference raises on NaN logits
            raise SpecplayError(f"the target model produced NaN logits ({exc}); try --dtype float32") \
                from None

    def _accept(self, s: BatchSequence, emitted: list, drafted: int, accepted: int, config) -> None:
        res = s.result
        res.rounds += 1
        res.drafted += drafted
        res.accepted += accepted
        if config.stop_at_eos and self.eos_ids:
            for i, token in enumerate(emitted):
                if token in self.eos_ids:
                    emitted, s.done, res.finish_reason = emitted[:i + 1], True, "eos"
                    break
        room = s.budget - len(res.ids)
        if len(emitted) >= room:
            emitted, s.done = emitted[:room], True
            res.finish_reason = res.finish_reason or "length"
        res.ids.extend(emitted)
        s.tokens.extend(emitted)


@dataclass
class _Simulated:
    accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
