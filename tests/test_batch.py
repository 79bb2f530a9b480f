"""Batched decoding: the batched forward, ragged acceptance, losslessness per sequence, roofline, CLI."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from spec_fixtures import make_close_pair_dirs
from tiny_models import make_tiny_llama

from engine.analysis.analytic import chi2_sf
from engine.analysis.lossless import chi_square, exact_two_token_distribution
from engine.bench import roofline
from engine.cli.batch import read_prompts_file
from engine.cli.main import main
from engine.config import GenerationConfig, SamplingParams
from engine.core.batch import BatchDecoder, pad_for_verify
from engine.core.decoder import SpeculativeDecoder
from engine.errors import SpecplayError
from engine.kernels import reference
from engine.methods.batch_base import BatchDraft
from engine.methods.registry import BATCH_METHODS
from engine.models.batch_runner import BatchRunner
from engine.models.loading import load_pair

PROMPTS = ["the cat sat on the mat. the cat sat on the", "a", "def f(x):\n    return x + 1\n\ndef g(x):\n",
           "hello hello hello world"]
BUDGETS = [24, 17, 30, 9]
METHODS = ("none", "draft", "ngram")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_close_pair_dirs(tmp_path_factory.mktemp("batch"))


@pytest.fixture(scope="module")
def pair(dirs):
    return load_pair(dirs[0], dirs[1], device="cpu", dtype=torch.float32)


def add_copied_eagle_head(model_dir) -> None:
    """An EAGLE head that drafts well for a one-layer target: fc = [0 | I] passes the next token's embedding
    through and the head's layer is the target's layer, so the head's feature at row t is the target's
    feature of position t + 1 without the first token in its context (rope is relative: the shift by one
    position changes nothing else). Random heads accept next to nothing; this one accepts most drafts."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    prefix = "model.layers.0."
    weights = load_file(str(model_dir / "model.safetensors"))
    tensors = {"layer." + name[len(prefix):]: t.contiguous() for name, t in weights.items()
               if name.startswith(prefix)}
    tensors["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    save_file(tensors, str(model_dir / "eagle_head.safetensors"))
    (model_dir / "eagle_config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_attention_heads": heads, "head_dim": hidden // heads,
        "num_key_value_heads": config["num_key_value_heads"], "rms_norm_eps": config["rms_norm_eps"],
        "intermediate_size": config["intermediate_size"], "rope_theta": 10000.0}))


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    target = make_tiny_llama(tmp_path_factory.mktemp("batch_eagle") / "target", vocab=96, hidden=64, layers=1,
                             seed=0)
    add_copied_eagle_head(target)
    return str(target)


@pytest.fixture(scope="module")
def eagle_pair(eagle_dir):
    return load_pair(eagle_dir, None, device="cpu", dtype=torch.float32, need_draft=False)


def plain_ids(decoder: SpeculativeDecoder, prompt, budget: int) -> list:
    return decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=budget))


# ------------------------------------------------------------------------------------------------ the runner
def test_batch_runner_matches_the_single_runner_per_sequence(pair):
    runner = pair.target
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 96, (n,), generator=gen) for n in (6, 11, 1)]
    batch = BatchRunner(runner, 3, 40)
    width = max(len(s) for s in seqs)
    block = torch.zeros(3, width, dtype=torch.long)
    for b, s in enumerate(seqs):
        block[b, :len(s)] = s
    logits, _ = batch.forward(block, [len(s) for s in seqs])  # ragged prefill, right-padded
    extra = torch.randint(3, 96, (3, 4), generator=gen)
    counts = [4, 2, 3]
    logits2, _ = batch.forward(extra, counts)
    assert batch.lengths == [10, 13, 4]
    for b, s in enumerate(seqs):
        runner.reset()
        ref = runner.forward(s).logits
        ref2 = runner.forward(extra[b, :counts[b]]).logits
        torch.testing.assert_close(logits[b, :len(s)], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits2[b, :counts[b]], ref2, atol=1e-5, rtol=1e-5)
    runner.reset()


def test_rollback_per_sequence(pair):
    """Rolling one sequence back and feeding other tokens gives what a fresh cache gives; the other
    sequences' caches are untouched."""
    runner = pair.target
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 96, (2, 7), generator=gen)
    batch = BatchRunner(runner, 2, 32)
    batch.forward(prefix)
    before = batch.forward(torch.tensor([[5], [6]]))[0]  # [2, 1, V]
    batch.rollback(0, 4)  # sequence 0 forgets 4 tokens; sequence 1 keeps its 8
    batch.rollback(1, 7)  # and sequence 1 forgets its last one
    assert batch.lengths == [4, 7]
    after = batch.forward(torch.tensor([[9, 9], [6, 0]]), [2, 1])[0]
    runner.reset()
    fresh0 = runner.forward(torch.cat([prefix[0, :4], torch.tensor([9, 9])])).logits[-1]
    torch.testing.assert_close(after[0, 1], fresh0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after[1, 0], before[1, 0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        batch.rollback(0, 99)
    runner.reset()


# ------------------------------------------------------------------------------------------------ padding
def _random_case(seed: int, batch=5, n=4, vocab=12):
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(batch, n + 1, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    # make real drafts often the argmax so that acceptance runs deep
    argmax = logits.argmax(-1)[:, :n]
    tokens = torch.where(torch.rand(batch, n, generator=gen) < 0.7, argmax, tokens)
    counts = [int(c) for c in torch.randint(0, n + 1, (batch,), generator=gen)]
    counts[0] = n
    return logits, tokens, counts, gen


@pytest.mark.parametrize("seed", range(6))
def test_padded_greedy_verification_equals_unpadded(seed):
    logits, tokens, counts, _ = _random_case(seed)
    draft = BatchDraft(tokens, counts)
    lp, tp, _ = pad_for_verify(logits, draft, [True] * len(counts))
    padded = reference.verify_chain_greedy(lp, tp)
    for b, c in enumerate(counts):
        alone = reference.verify_chain_greedy(logits[b:b + 1, :c + 1], tokens[b:b + 1, :c])
        assert int(padded.accepted[b]) == int(alone.accepted[0]) <= c
        assert int(padded.next_token[b]) == int(alone.next_token[0])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_probs", [False, True])
def test_padded_stochastic_verification_equals_unpadded(seed, with_probs):
    """Same uniforms (the pad's correction uniform is column N, the unpadded run's n_b): same result."""
    logits, tokens, counts, gen = _random_case(seed)
    batch, n, vocab = tokens.shape[0], tokens.shape[1], logits.shape[-1]
    probs = torch.softmax(torch.randn(batch, n, vocab, generator=gen), -1) if with_probs else None
    uniforms = torch.rand(batch, n + 1, generator=gen)
    lp, tp, pp = pad_for_verify(logits, BatchDraft(tokens, counts, probs), [True] * batch)
    padded = reference.verify_chain_stochastic(lp, tp, pp, uniforms, 0.9, 0, 0.95)
    for b, c in enumerate(counts):
        u = torch.cat([uniforms[b, :c], uniforms[b, n:]])[None]
        q = probs[b:b + 1, :c] if with_probs else None
        alone = reference.verify_chain_stochastic(logits[b:b + 1, :c + 1], tokens[b:b + 1, :c], q, u,
                                                  0.9, 0, 0.95)
        assert int(padded.accepted[b]) == int(alone.accepted[0]) <= c
        assert int(padded.next_token[b]) == int(alone.next_token[0]) < vocab


def test_unragged_drafts_are_not_padded():
    logits = torch.randn(2, 3, 8)
    draft = BatchDraft(torch.zeros(2, 2, dtype=torch.long), [2, 0])
    out = pad_for_verify(logits, draft, [True, False])  # the ragged row is finished: nothing to pad
    assert out[0] is logits


# ------------------------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("method", METHODS)
def test_batched_greedy_equals_batch1_plain_per_sequence(pair, method):
    """Ragged prompt lengths, ragged budgets, one sequence ending on EOS early: each sequence's output is its
    batch-1 plain greedy output."""
    single = SpeculativeDecoder(pair)
    first = plain_ids(single, PROMPTS[0], 30)
    stop = next(i for i in range(4, 30) if first[i] not in first[:i])
    eos = first[stop]  # a token sequence 0 emits early, for the first time
    single.eos_ids = {2, eos}
    batched = BatchDecoder(pair)
    batched.eos_ids = {2, eos}
    config = GenerationConfig(method=method, k=3, max_new_tokens=30)
    result = batched.generate(PROMPTS, config, budgets=BUDGETS)
    for prompt, budget, seq in zip(PROMPTS, BUDGETS, result.sequences, strict=True):
        assert seq.ids == plain_ids(single, prompt, budget), (method, seq.index)
    assert result.sequences[0].finish_reason == "eos" and len(result.sequences[0].ids) == stop + 1
    assert len({s.rounds for s in result.sequences}) > 1  # sequences finished at different rounds
    assert result.rounds == max(s.rounds for s in result.sequences)
    assert result.tokens == sum(len(s.ids) for s in result.sequences)
    if method != "none":
        assert sum(s.accepted for s in result.sequences) > 0


def test_batch_of_one_and_repeated_runs(pair):
    """B = 1 is the same loop; a decoder reused for another batch size gives the same outputs."""
    single = SpeculativeDecoder(pair)
    batched = BatchDecoder(pair)
    config = GenerationConfig(method="draft", k=4, max_new_tokens=16)
    one = batched.generate(PROMPTS[:1], config)
    assert one.sequences[0].ids == plain_ids(single, PROMPTS[0], 16)
    three = batched.generate(PROMPTS[1:], config)
    for prompt, seq in zip(PROMPTS[1:], three.sequences, strict=True):
        assert seq.ids == plain_ids(single, prompt, 16)
    assert 0 < three.tokens_per_round <= 5 and three.summary()["batch"] == 3


def test_unbatched_methods_are_refused(pair):
    with pytest.raises(Exception, match="not batched"):
        BatchDecoder(pair).generate(PROMPTS, GenerationConfig(method="lookahead"))


# ------------------------------------------------------------------------------------------------ EAGLE
def test_batch_runner_forward_embeds_matches_the_single_runner(eagle_pair):
    """The batched forward from input vectors (EAGLE's fused inputs), ragged, equals the single runner's
    forward_embeds per sequence, logits and features."""
    runner = BatchDecoder(eagle_pair).eagle_head().runner
    gen = torch.Generator().manual_seed(3)
    lengths, extra = [5, 1, 8], [3, 1, 2]
    first = torch.randn(3, max(lengths), 64, generator=gen)
    second = torch.randn(3, max(extra), 64, generator=gen)
    batch = BatchRunner(runner, 3, 32)
    logits, hidden = batch.forward_embeds(first, lengths)
    logits2, hidden2 = batch.forward_embeds(second, extra)
    assert batch.lengths == [8, 2, 10]
    for b in range(3):
        runner.reset()
        ref = runner.forward_embeds(first[b, :lengths[b]])
        ref2 = runner.forward_embeds(second[b, :extra[b]])
        torch.testing.assert_close(logits[b, :lengths[b]], ref.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[b, :lengths[b]], ref.hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits2[b, :extra[b]], ref2.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden2[b, :extra[b]], ref2.hidden, atol=1e-5, rtol=1e-5)
    runner.reset()


def test_batched_eagle_greedy_equals_batch1_plain_and_drafts_like_batch1_eagle(eagle_pair):
    """Ragged prompts (one of a single token: no feature to draft from in its first round), ragged budgets,
    one sequence ending on EOS early: each sequence's output is its batch-1 plain greedy output, and it drafts
    and accepts what the single-sequence EAGLE chain does round for round (the head batched, each sequence's
    head cache at its own length, rolled back to its accepted rows)."""
    single = SpeculativeDecoder(eagle_pair)
    first = plain_ids(single, PROMPTS[0], 30)
    stop = next(i for i in range(4, 30) if first[i] not in first[:i])
    eos = first[stop]
    single.eos_ids = {2, eos}
    batched = BatchDecoder(eagle_pair, eagle_head=single.eagle_head)  # the loaded decoder's head, shared
    batched.eos_ids = {2, eos}
    config = GenerationConfig(method="eagle", k=3, max_new_tokens=30)
    result = batched.generate(PROMPTS, config, budgets=BUDGETS)
    assert batched.eagle_head() is single.eagle_head()
    for prompt, budget, seq in zip(PROMPTS, BUDGETS, result.sequences, strict=True):
        assert seq.ids == plain_ids(single, prompt, budget), seq.index
        events = list(single.generate(prompt, replace(config, max_new_tokens=budget)))
        assert seq.rounds == len(events), seq.index
        assert seq.drafted == sum(len(e.drafted) for e in events), seq.index
        assert seq.accepted == sum(e.accepted_count for e in events), seq.index
    assert result.sequences[0].finish_reason == "eos" and len(result.sequences[0].ids) == stop + 1
    assert len({s.rounds for s in result.sequences}) > 1  # sequences finished at different rounds
    assert result.sequences[1].drafted == 3 * (result.sequences[1].rounds - 1)  # "a": no draft in round 1
    assert sum(s.accepted for s in result.sequences) > 0.3 * sum(s.drafted for s in result.sequences)
    assert {acc for (_drafted, acc) in result.outcomes} >= {0, 3}  # ragged acceptance
    again = batched.generate(PROMPTS[1:3], config)  # another batch size reuses the decoder
    for prompt, seq in zip(PROMPTS[1:3], again.sequences, strict=True):
        assert seq.ids == plain_ids(single, prompt, 30)


def test_batched_eagle_of_one_prompt_and_other_ks(eagle_pair):
    single = SpeculativeDecoder(eagle_pair)
    batched = BatchDecoder(eagle_pair)  # loads the head itself
    for k in (1, 5):
        result = batched.generate(PROMPTS[:1], GenerationConfig(method="eagle", k=k, max_new_tokens=20))
        assert result.sequences[0].ids == plain_ids(single, PROMPTS[0], 20), k
        assert result.sequences[0].accepted > 0


def test_batched_eagle_needs_a_head_and_a_chain(pair, eagle_pair):
    with pytest.raises(SpecplayError, match="needs the target's EAGLE head") as caught:
        BatchDecoder(pair).generate(PROMPTS, GenerationConfig(method="eagle"))
    assert "\n" not in str(caught.value) and "eagle_head.safetensors" in str(caught.value)
    with pytest.raises(SpecplayError, match="chain"):
        BatchDecoder(eagle_pair).generate(PROMPTS, GenerationConfig(method="eagle", tree_nodes=8))


# ------------------------------------------------------------------------------------------------ sampling
@pytest.fixture
def padded_rounds(monkeypatch):
    """Counts the rounds whose drafts were ragged (padded with the impossible column)."""
    import engine.core.batch as batch_module

    count = [0]
    original = batch_module.pad_for_verify

    def counting(logits, draft, live):
        out = original(logits, draft, live)
        count[0] += out[0].shape[-1] > logits.shape[-1]
        return out

    monkeypatch.setattr(batch_module, "pad_for_verify", counting)
    return count


def test_ragged_ngram_rounds_are_padded_and_lossless(pair, padded_rounds):
    single = SpeculativeDecoder(pair)
    result = BatchDecoder(pair).generate(PROMPTS, GenerationConfig(method="ngram", k=4, max_new_tokens=24))
    assert padded_rounds[0] > 0
    for prompt, seq in zip(PROMPTS, result.sequences, strict=True):
        assert seq.ids == plain_ids(single, prompt, 24)


@pytest.mark.slow  # a statistical check: `make test-fast` skips it
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_chi_square_per_sequence(pair, method, padded_rounds):
    """The first two sampled tokens of every sequence of a batch follow that sequence's exact target
    distribution. Each prompt fills COPIES rows (independent uniforms per row), over SEEDS seeds."""
    copies, seeds = 100, 3
    prompts = PROMPTS[:3]
    sampling = SamplingParams(0.8, 4, 0.95)  # top-k keeps the joint small enough for 300 samples per prompt
    single = SpeculativeDecoder(pair)
    batched = BatchDecoder(pair)
    config = GenerationConfig(method=method, k=3, sampling=sampling, max_new_tokens=2, stop_at_eos=False)
    counts = [dict() for _ in prompts]
    rows = [p for p in prompts for _ in range(copies)]
    for seed in range(seeds):
        result = batched.generate(rows, replace(config, seed=seed))
        for i, seq in enumerate(result.sequences):
            key = tuple(seq.ids[:2])
            counts[i // copies][key] = counts[i // copies].get(key, 0) + 1
    samples = copies * seeds
    for prompt, observed in zip(prompts, counts, strict=True):
        expected = exact_two_token_distribution(single, prompt, sampling)
        statistic, bins = chi_square(observed, expected, samples)
        p_value = chi2_sf(statistic, max(bins - 1, 1))
        assert bins >= 3 and p_value > 1e-3, (method, prompt, statistic, bins)
    if method == "ngram":
        assert padded_rounds[0] > 0  # the ragged (padded) verification was sampled through


@pytest.mark.slow  # a statistical check: `make test-fast` skips it
def test_chi_square_per_sequence_eagle(eagle_pair, padded_rounds):
    """The same check for EAGLE's chain, drafted by sampling the head's q: the one-token prompt drafts
    nothing in its first round, so that round's verification is ragged (padded)."""
    test_chi_square_per_sequence(eagle_pair, "eagle", padded_rounds)
    assert padded_rounds[0] > 0


def test_sampled_eagle_accepts_drafts(eagle_pair):
    sampling = SamplingParams(0.8, 4, 0.95)
    config = GenerationConfig(method="eagle", k=3, sampling=sampling, max_new_tokens=16, seed=5)
    result = BatchDecoder(eagle_pair).generate(PROMPTS, config)
    again = BatchDecoder(eagle_pair).generate(PROMPTS, config)
    assert [s.ids for s in result.sequences] == [s.ids for s in again.sequences]  # a seed reproduces the run
    assert sum(s.accepted for s in result.sequences) > 0.3 * sum(s.drafted for s in result.sequences)


# ------------------------------------------------------------------------------------------------ roofline
def _hand_made(floor=10.0, per_token=0.05, noise=0.03):
    gen = torch.Generator().manual_seed(0)
    points = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for tokens in (b, 5 * b):
            wobble = 1 + noise * float(torch.randn(1, generator=gen))
            points.append((tokens, max(floor, per_token * tokens) * wobble))
    return points


def test_roofline_fit_finds_the_knee():
    fit = roofline.fit_roofline(_hand_made())
    assert fit.floor_ms == pytest.approx(10.0, rel=0.05)
    assert fit.ms_per_token == pytest.approx(0.05, rel=0.05)
    assert fit.knee == pytest.approx(200, rel=0.1)
    rates = fit.rates(weight_bytes=10**9, flops_per_token=2e9)
    assert rates["bandwidth"] == pytest.approx(1e11, rel=0.05)  # 1 GB per 10 ms
    assert rates["matmul_flops"] == pytest.approx(4e13, rel=0.05)  # 2 GFLOP per 50 us


def test_roofline_memory_bound_only():
    fit = roofline.fit_roofline([(t, 3.0) for t in (1, 2, 4, 8)])
    assert fit.ms_per_token == 0 and math.isinf(fit.knee) and fit.step_ms(10**6) == pytest.approx(3.0)


def test_roofline_predicts_the_crossover_and_best_k():
    fit = roofline.Roofline(10.0, 0.05)  # knee at 200 tokens per forward
    e = roofline.tokens_for_k([0.8, 0.75, 0.7, 0.7], 4)  # E at K = 4
    small = roofline.predicted_speedup(fit, 1, 4, e)
    assert small == pytest.approx(e)  # B (K+1) = 5 tokens: verification is free
    big = roofline.predicted_speedup(fit, 512, 4, e)
    assert big == pytest.approx(e * (0.05 * 512) / (0.05 * 512 * 5))
    assert big < 1
    cross = roofline.predicted_crossover(fit, 4, lambda b: e)
    assert cross is not None and 40 < cross < 200
    assert roofline.predicted_speedup(fit, cross, 4, e) < 1
    assert roofline.predicted_speedup(fit, cross / 1.2, 4, e) >= 1
    assert roofline.best_k(fit, 1, [0.8, 0.75, 0.7], [1, 2, 4, 8])[0] >= 4
    assert roofline.best_k(fit, 4096, [0.8, 0.75, 0.7], [1, 2, 4, 8]) == (0, 1.0)
    draft = roofline.Roofline(1.0, 0.0)
    assert roofline.predicted_speedup(fit, 1, 4, e, draft) == pytest.approx(e * 10 / 14)


def test_measured_crossover_interpolates():
    assert roofline.crossover([1, 2, 4, 8], [2.0, 1.5, 1.2, 0.8]) == pytest.approx(2 ** 2.5)
    assert roofline.crossover([1, 2], [0.9, 0.5]) == 1.0
    assert roofline.crossover([1, 2], [1.9, 1.5]) is None
    assert roofline.crossover([1, 2, 4, 8], [0.8, 1.5, 1.2, 0.8]) == pytest.approx(2 ** 2.5)  # a dip first
    assert roofline.crossover([1, 2, 4], [1.5, 0.9, 1.1]) is None  # recovered at the end


# ------------------------------------------------------------------------------------------------ CLI
def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cache_rows_per_round_are_the_rows_plain_rounds_attend(pair, monkeypatch):
    """The bound's cache term counts what the engine's plain rounds read: every live sequence's cached rows,
    its new token's included (ragged prompts and budgets, sequences finishing at different rounds)."""
    from engine.bench.batch import cache_rows_per_round

    attended = []
    forward = BatchRunner.forward

    def counting(runner, tokens, counts=None, with_logits=True, **kw):
        out = forward(runner, tokens, counts, with_logits, **kw)
        if with_logits:  # a round, not the prefill
            attended.append(sum(length for length, c in zip(runner.lengths, counts, strict=True) if c))
        return out

    monkeypatch.setattr(BatchRunner, "forward", counting)
    result = BatchDecoder(pair).generate(PROMPTS, GenerationConfig(method="none", max_new_tokens=30),
                                         budgets=BUDGETS, texts=False)
    assert len({s.rounds for s in result.sequences}) > 1
    assert len(attended) == result.rounds
    assert cache_rows_per_round(result) * result.rounds == pytest.approx(sum(attended))


def test_cache_bytes_per_row_are_the_batched_cache_of_one_token(pair):
    from engine.models.synthetic import cache_bytes_per_row

    runner = BatchRunner(pair.target, 3, 20)
    kv = runner.kv  # [L, 2, B, kvh, max_length, D]
    assert cache_bytes_per_row(pair.target) == kv.numel() * kv.element_size() // (3 * 20)


def test_plain_bound_counts_the_weights_and_the_cache_rows_read():
    """The bound of a plain round: its bytes at the read rate, or its products at the matmul rate when that
    takes longer; a report saved before the cache term (no cache bytes) keeps the weights-only bound."""
    from engine.bench.batch import BatchReport, BatchRow, plain_bound_ms, predict

    row = BatchRow(batch=64, plain_tokens_per_s=1.0, spec_tokens_per_s=1.0, tokens_per_round=1.0,
                   plain_tokens_per_round=1.0, acceptance_rate=0.5, plain_round_ms=8.0, spec_round_ms=9.0,
                   step_ms=7.0, verify_step_ms=12.0, plain_cache_rows=64 * 140.0)
    report = BatchReport(rows=[row], method="draft", k=4, ks=[4], device="test", max_new_tokens=64,
                         target_fit=roofline.Roofline(0.0, 0.0), draft_fit=None, weight_bytes=15e9,
                         flops_per_token=16e9, bandwidth=3e12, matmul_flops=700e12,
                         cache_bytes_per_row=131072)
    cache_ms = 1000.0 * 131072 * 64 * 140 / 3e12  # 0.39 ms
    assert plain_bound_ms(report, row) == pytest.approx(5.0 + cache_ms)
    predict(report)
    assert row.plain_pct_bound == pytest.approx(100.0 * (5.0 + cache_ms) / 8.0)
    assert row.plain_pct_weights == pytest.approx(100.0 * 5.0 / 8.0)
    assert plain_bound_ms(replace(report, cache_bytes_per_row=0), row) == pytest.approx(5.0)
    # compute-bound: 4,096 rows of 16 GFLOP at 700 TFLOP/s take longer than the bytes
    wide = replace(row, batch=4096)
    assert plain_bound_ms(report, wide) == pytest.approx(1000.0 * 16e9 * 4096 / 700e12)


def test_prompts_file_unescapes_and_skips_blank_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("line one\n\n  \ndef f():\\n    return 1\nback\\\\slash\n", encoding="utf-8")
    assert read_prompts_file(str(path)) == ["line one", "def f():\n    return 1", "back\\slash"]


def test_run_prompts_file(dirs, capsys, tmp_path):
    target, draft = dirs
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(p.replace("\n", "\\n") for p in PROMPTS) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "run", "--prompts-file", str(path), "--target", target, "--draft", draft,
                             "--k", "3", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == len(PROMPTS) + 1
    assert [entry["prompt"] for entry in lines[:-1]] == PROMPTS
    summary = lines[-1]["batch"]
    assert summary["batch"] == len(PROMPTS) and summary["method"] == "draft"
    assert summary["tokens"] == sum(entry["tokens"] for entry in lines[:-1])
    code, out, err = run_cli(capsys, "run", "--prompts-file", str(path), "--target", target,
                             "--method", "ngram", "--max-new-tokens", "8")
    assert code == 0, err
    assert out.count("=== prompt") == len(PROMPTS) and "tokens/s" in err


def test_bench_batch_json(dirs, capsys):
    target, draft = dirs
    code, out, err = run_cli(capsys, "bench", "batch", "--target", target, "--draft", draft,
                             "--batches", "1,2", "--k", "2", "--ks", "1,2", "--batch-new-tokens", "6",
                             "--prompt", PROMPTS[0], "--json")
    assert code == 0, err
    report = json.loads(out)
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    for key in ("plain_tokens_per_s", "spec_tokens_per_s", "speedup", "predicted_speedup", "step_ms",
                "verify_step_ms", "draft_step_ms", "best_k", "tokens_per_round"):
        assert key in report["rows"][0]
    for key in ("fit", "measured_crossover", "predicted_crossover", "measured_matmul_flops",
                "measured_bandwidth", "fit_bandwidth"):
        assert key in report
    # a saved report refitted from its own measurements gives its predictions back
    from engine.bench.batch import refit_report

    again = refit_report(json.loads(json.dumps(report)))
    assert again["fit"] == pytest.approx(report["fit"])
    assert again["predicted_crossover"] == report["predicted_crossover"]
    for mine, theirs in zip(again["rows"], report["rows"], strict=True):
        for key in ("predicted_speedup", "best_k", "best_k_speedup", "plain_pct_bound", "speedup", "step_ms"):
            assert mine[key] == pytest.approx(theirs[key]), key
    assert all(r["plain_pct_bound"] > r["plain_pct_weights"] > 0 for r in report["rows"])
    # a report saved before the cache term refits to the weights-only bound and says so
    old = json.loads(json.dumps(report))
    del old["cache_bytes_per_row"]
    for r in old["rows"]:
        del r["plain_cache_rows"]
    refitted = refit_report(old)
    assert all(r["plain_pct_bound"] == pytest.approx(r["plain_pct_weights"]) for r in refitted["rows"])
    from engine.bench.batch import format_json

    assert "cache not recorded" in format_json(refitted)


def test_bench_batch_table(dirs, capsys):
    target, _ = dirs
    code, out, err = run_cli(capsys, "bench", "batch", "--target", target, "--method", "ngram",
                             "--batches", "2", "--k", "2", "--ks", "2", "--batch-new-tokens", "4",
                             "--prompt", PROMPTS[3], "--sweep-k")
    assert code == 0, err
    assert "crossover" in out and "roofline fit" in out and "measured K sweep" in out


def test_run_prompts_file_and_bench_batch_with_eagle(eagle_dir, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(p.replace("\n", "\\n") for p in PROMPTS) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "run", "--prompts-file", str(path), "--target", eagle_dir,
                             "--method", "eagle", "--k", "3", "--max-new-tokens", "12", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    summary = lines[-1]["batch"]
    assert len(lines) == len(PROMPTS) + 1 and summary["method"] == "eagle" and summary["accepted"] > 0
    code, out, err = run_cli(capsys, "bench", "batch", "--target", eagle_dir, "--method", "eagle",
                             "--batches", "1,2", "--k", "2", "--ks", "1,2", "--batch-new-tokens", "6",
                             "--prompt", PROMPTS[0], "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["method"] == "eagle" and [r["batch"] for r in report["rows"]] == [1, 2]
    assert all(r["draft_step_ms"] > 0 and r["spec_tokens_per_s"] > 0 for r in report["rows"])
    assert report["draft_fit"] is not None  # the head's steps are in the roofline's round


@pytest.mark.parametrize("argv,needle", [
    (["run", "--prompts-file", "PROMPTS", "--method", "eagle"], "EAGLE head"),
    (["bench", "batch", "--method", "eagle", "--batches", "1", "--batch-new-tokens", "2"], "EAGLE head"),
    (["run", "--prompts-file", "PROMPTS", "--method", "eagle:8"], "chain"),
    (["bench", "batch", "--method", "eagle:8", "--batches", "1"], "chain"),
])
def test_batched_eagle_inputs_one_line_exit_2(dirs, capsys, tmp_path, argv, needle):
    """The target of `dirs` has no EAGLE head; batched EAGLE is a chain."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n", encoding="utf-8")
    argv = [str(prompts) if a == "PROMPTS" else a for a in argv]
    code, _out, err = run_cli(capsys, *argv, "--target", dirs[0])
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["bench", "batch", "--batches", "1,x"], "--batches"),
    (["bench", "batch", "--batches", "0,2"], "--batches"),
    (["bench", "batch", "--batches", ""], "--batches"),
    (["bench", "batch", "--method", "none", "--batches", "1"], "--method"),
    (["bench", "batch", "--batch-new-tokens", "0"], "--batch-new-tokens"),
    (["bench", "batch", "--device", "cpu", "--batches", "1,4096"], "up to 64"),
    (["run"], "--prompt"),
    (["run", "--prompts-file", "/nonexistent/prompts.txt"], "prompts-file"),
    (["run", "--prompts-file", "EMPTY"], "no prompts"),
    (["run", "--prompts-file", "EMPTY", "--method", "medusa"], "--prompts-file"),
])
def test_bad_batch_inputs_one_line_exit_2(dirs, capsys, tmp_path, argv, needle):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    code, _out, err = run_cli(capsys, *argv, "--target", dirs[0], "--draft", dirs[1])
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_plot_script_writes_an_svg(tmp_path):
    import importlib.util
    import xml.dom.minidom
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "docs" / "plot_batch.py"
    spec = importlib.util.spec_from_file_location("plot_batch", script)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = [{"batch": b, "speedup": s, "predicted_speedup": p}
            for b, s, p in ((1, 2.5, 2.7), (8, 2.0, 2.2), (64, 0.9, 1.0), (256, 0.4, 0.45))]
    report = {"rows": rows, "method": "draft", "k": 4, "device": "GPU", "fit": {"knee_tokens": 300.0},
              "measured_crossover": 50.0, "predicted_crossover": 64.0}
    src, out = tmp_path / "b.json", tmp_path / "b.svg"
    src.write_text(json.dumps(report), encoding="utf-8")
    assert plot.main([str(src), str(out)]) == 0
    svg = out.read_text(encoding="utf-8")
    xml.dom.minidom.parseString(svg)
    assert "measured crossover" in svg and "predicted crossover" in svg


def test_per_position_acceptance_from_outcomes():
    from engine.core.batch import BatchResult

    result = BatchResult([], "draft", 3, outcomes={(3, 0): 2, (3, 3): 1, (3, 1): 1, (1, 1): 1})
    # depth 0: tested 5, accepted 3; depth 1: tested 2 ((3,3), (3,1)), accepted 1; depth 2: 1 of 1
    assert result.per_position_acceptance == pytest.approx([3 / 5, 1 / 2, 1.0])


def test_every_batch_size_decodes_the_whole_prompt_pool():
    """bench batch's prompt groups: B = 1 decodes every prompt of the pool, not the first alone, so the
    tokens per round of each batch size come from the same prompts."""
    from engine.bench.batch import prompt_groups

    pool = ["a", "b", "c", "d"]
    assert prompt_groups(pool, 1) == [["a"], ["b"], ["c"], ["d"]]
    assert prompt_groups(pool, 2) == [["a", "b"], ["c", "d"]]
    assert prompt_groups(pool, 3) == [["a", "b", "c"], ["d", "a", "b"]]
    assert prompt_groups(pool, 4) == [pool]
    assert prompt_groups(pool, 6) == [["a", "b", "c", "d", "a", "b"]]


def test_timed_runs_of_every_group_reuse_the_warmed_caches(pair, monkeypatch):
    """B = 1 over a pool of prompts of different lengths: the warm-up takes the longest prompt's group, so no
    timed run allocates a batched cache (nor captures its steps) for a longer context."""
    from engine.bench import batch as batch_bench
    from engine.core import batch
    from engine.methods.draft_model import batch as draft_batch

    built = []
    real = batch.BatchRunner

    def counted(*args, **kwargs):
        built.append(args[2])  # max_length
        return real(*args, **kwargs)

    timed_fastest = batch_bench._fastest
    built_while_timed = []

    def fastest(*args, **kwargs):
        before = len(built)
        try:
            return timed_fastest(*args, **kwargs)
        finally:
            built_while_timed.append(len(built) - before)

    monkeypatch.setattr(batch, "BatchRunner", counted)
    monkeypatch.setattr(draft_batch, "BatchRunner", counted)
    monkeypatch.setattr(batch_bench, "_fastest", fastest)
    decoder = BatchDecoder(pair)
    pool = sorted(PROMPTS, key=len)  # the longest prompt last: warming up on the first group would not do
    groups = batch_bench.prompt_groups(pool, 1)
    assert batch_bench._widest(decoder, groups) == [pool[-1]]
    config = GenerationConfig(method="draft", k=2, max_new_tokens=6)
    plain, spec, _ = batch_bench.measure_batch(decoder, groups, config)
    assert plain.groups == spec.groups == len(pool) and plain.batch == 1
    assert len(built) >= 2  # the warm-ups built the target's and the draft model's runners
    assert built_while_timed == [0, 0]  # the plain and the speculative timed runs built none


def test_merged_results_sum_batches_run_one_after_another():
    from engine.core.batch import BatchResult, SequenceResult, merged_results

    def result(tokens: list, rounds: int, seconds: float, outcomes: dict) -> BatchResult:
        seqs = [SequenceResult(i, 5, ids=list(range(t))) for i, t in enumerate(tokens)]
        return BatchResult(seqs, "draft", 2, rounds=rounds, seconds=seconds, outcomes=outcomes)

    one = result([6, 6], 3, 0.5, {(2, 1): 4, (2, 2): 2})
    two = result([4, 4], 2, 1.5, {(2, 0): 3, (2, 2): 1})
    merged = merged_results([one, two])
    assert merged.batch == 2 and merged.groups == 2 and len(merged.sequences) == 4
    assert merged.tokens == 20 and merged.rounds == 5 and merged.seconds == pytest.approx(2.0)
    assert merged.tokens_per_s == pytest.approx(10.0)
    assert merged.tokens_per_round == pytest.approx(20 / (5 * 2))  # each forward decodes 2 sequences
    assert merged.outcomes == {(2, 1): 4, (2, 2): 3, (2, 0): 3}
    alone = BatchResult([], "draft", 2, outcomes=merged.outcomes)
    assert merged.per_position_acceptance == alone.per_position_acceptance
    assert merged_results([one]).tokens_per_round == one.tokens_per_round


def test_cli_glue_stays_light():
    """engine.cli.main imports the glue at start-up: it must not pull in torch (every CLI call would pay)."""
    import subprocess
    import sys

    code = "import sys, engine.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.stdout.strip() == "False"
    # one list of batched methods: the registry's flag
    assert BATCH_METHODS == ("none", "draft", "ngram", "eagle")


def test_simulated_acceptance(pair):
    """A synthetic rate forces the acceptance (a timing study): rate 1 accepts every draft, rate 0 none."""
    batched = BatchDecoder(pair)
    for rate, per_round in (("1,", 4.0), ("0,", 1.0)):
        config = GenerationConfig(method="draft", k=3, max_new_tokens=12, stop_at_eos=False,
                                  synthetic_acceptance=rate)
        result = batched.generate(PROMPTS[:2], config, until_first_done=True)
        assert result.summary()["synthetic_acceptance"] == rate
        assert result.tokens_per_round == pytest.approx(per_round)


def test_bench_batch_simulated_acceptance_is_labelled(dirs, capsys):
    target, draft = dirs
    code, out, err = run_cli(capsys, "bench", "batch", "--target", target, "--draft", draft,
                             "--batches", "1", "--k", "2", "--ks", "2", "--batch-new-tokens", "6",
                             "--prompt", PROMPTS[0], "--acceptance", "0.8")
    assert code == 0, err
    assert "SYNTHETIC acceptance" in out and "rates 0.8," in out
    code, _out, err = run_cli(capsys, "bench", "batch", "--target", target, "--draft", draft,
                              "--acceptance", "1.5")
    assert code == 2 and "--acceptance" in err


def test_a_sequence_finishing_first_leaves_room_for_the_others(pair):
    """The longest prompt finishes first on a last round cut short by its budget, with K = 8 drafts all
    accepted: its padding blocks in the later rounds must still fit the batched cache."""
    batched = BatchDecoder(pair)
    config = GenerationConfig(method="draft", k=8, max_new_tokens=30, stop_at_eos=False,
                              synthetic_acceptance="1,")
    result = batched.generate(["the cat sat on the mat. " * 3, "q"], config, budgets=[19, 30])
    assert [len(s.ids) for s in result.sequences] == [19, 30]
    assert result.sequences[0].rounds < result.sequences[1].rounds


def test_roofline_fit_with_an_intercept():
    """A step that grows before it is compute-bound (launches, a CPU): the tail line gets an intercept."""
    points = [(t, max(2.0, 1.0 + 0.1 * t)) for t in (1, 2, 5, 10, 20, 40, 80, 160)]
    fit = roofline.fit_roofline(points)
    assert fit.floor_ms == pytest.approx(2.0)
    assert fit.ms_per_token == pytest.approx(0.1) and fit.intercept_ms == pytest.approx(1.0)
    assert fit.knee == pytest.approx(10.0)
    assert fit.as_dict()["intercept_ms"] == pytest.approx(1.0)


def test_roofline_fit_joins_the_roofs_smoothly_where_the_steps_turn_gradually():
    """Steps that bend from the floor to the compute line gradually (a GPU near its knee) fit the smooth join
    of the two roofs; steps with a sharp knee keep the pure roofline (its max)."""
    true = roofline.Roofline(5.0, 0.03, intercept_ms=1.5, p=2.0)
    tokens = (1, 4, 5, 16, 20, 64, 80, 128, 256, 320, 640, 1280)
    fit = roofline.fit_roofline([(t, true.step_ms(t)) for t in tokens])
    assert fit.p == 2.0 and fit.as_dict()["smoothness"] == 2.0
    for t in (2, 50, 100, 200, 1000):
        assert fit.step_ms(t) == pytest.approx(true.step_ms(t), rel=0.01)
    assert fit.floor_ms == pytest.approx(5.0, rel=0.03) and fit.ms_per_token == pytest.approx(0.03, rel=0.03)
    sharp = roofline.fit_roofline([(t, max(5.0, 0.03 * t)) for t in tokens])
    assert math.isinf(sharp.p) and sharp.as_dict()["smoothness"] is None
    assert sharp.knee == pytest.approx(5.0 / 0.03, rel=0.01)
    # a smooth join's step lies above both roofs, by at most 2^(1/p) where they meet
    knee = true.knee
    assert true.step_ms(knee) == pytest.approx(5.0 * 2 ** 0.5)
    assert true.step_ms(1) > 5.0 and true.step_ms(1280) > 1.5 + 0.03 * 1280


def test_bench_batch_stops_when_progress_says_so_and_reports_what_it_measured(pair):
    from engine.bench import batch as batch_bench

    seen = []

    def progress(row) -> bool:
        seen.append(row.batch)
        return len(seen) < 2  # stop after the second batch

    config = GenerationConfig(method="draft", k=2, max_new_tokens=6)
    report = batch_bench.bench_batch(BatchDecoder(pair), [PROMPTS[0]], config, [1, 2, 4], [1, 2],
                                     progress=progress)
    assert seen == [1, 2] and [r.batch for r in report.rows] == [1, 2]
    curve = batch_bench.predicted_curve(report, max_batch=8)
    assert curve[0][0] == 1 and curve[-1][0] == pytest.approx(8) and len(curve) == 3 * 8 + 1
    at = dict(curve)
    for row in report.rows:  # the curve passes through each row's prediction
        assert at[row.batch] == pytest.approx(row.predicted_speedup)
