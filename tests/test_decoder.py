"""The round loop on tiny random models: greedy equality, cache rollback, events and metrics."""
import pytest
import torch
from spec_fixtures import make_close_decoder
from tiny_models import make_tiny_llama, make_tiny_pair

from engine.config import GenerationConfig, SamplingParams
from engine.core.decoder import SpeculativeDecoder
from engine.methods.ngram.drafter import lookup_continuation
from engine.models.loading import load_pair, load_runner

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


@pytest.fixture(scope="module")
def close_decoder(tmp_path_factory):
    """A draft close to the target: partial acceptance is common."""
    return make_close_decoder(tmp_path_factory.mktemp("close"))


@pytest.fixture(scope="module")
def self_draft_decoder(tmp_path_factory):
    """Draft = the target itself: every greedy draft is accepted (exercises the bonus path)."""
    target, _ = make_tiny_pair(tmp_path_factory.mktemp("self"))
    return SpeculativeDecoder(load_pair(str(target), str(target), device="cpu"))


def plain_greedy(decoder, prompt, n):
    return decoder.generate_ids(prompt, GenerationConfig(method="none", max_new_tokens=n))


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_equals_plain_greedy(close_decoder, method, k):
    decoder = close_decoder
    reference = plain_greedy(decoder, PROMPT, 48)
    spec = decoder.generate_ids(PROMPT, GenerationConfig(method=method, k=k, max_new_tokens=48))
    assert spec == reference


def test_plain_greedy_matches_transformers_generate(decoder, tmp_path):
    from tiny_models import load_hf_reference

    model = load_hf_reference(decoder.pair.target_name)
    ids = decoder.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert plain_greedy(decoder, PROMPT, 24) == out[0, len(ids):].tolist()


def test_self_draft_accepts_everything(self_draft_decoder):
    config = GenerationConfig(method="draft", k=4, max_new_tokens=40)
    events = list(self_draft_decoder.generate(PROMPT, config))
    assert all(e.accepted_count == 4 and e.next_is_bonus for e in events[:-1])
    assert events[-1].metrics.acceptance_rate == pytest.approx(1.0)
    assert events[-2].metrics.tokens_per_forward == pytest.approx(5.0)
    assert self_draft_decoder.generate_ids(PROMPT, config) == \
        plain_greedy(self_draft_decoder, PROMPT, 40)


def _fresh_next_logits(path, ids):
    runner = load_runner(path, device="cpu")
    return runner.forward(torch.tensor(ids)).logits[-1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_after_rejection_equal_fresh_prefill(close_decoder, temperature):
    decoder = close_decoder
    config = GenerationConfig(method="draft", k=4, sampling=SamplingParams(temperature), max_new_tokens=60,
                              seed=3)
    prompt_ids = decoder.tokenizer.encode(PROMPT, add_special_tokens=False)
    generated = []
    gen = decoder.generate(PROMPT, config)
    for event in gen:
        generated += event.emitted_ids
        if 0 < event.accepted_count < len(event.drafted) and event.round > 0:
            break
    else:
        pytest.fail("no round with a partial acceptance")
    tokens = prompt_ids + generated
    # the target cache holds every committed token but the last; the draft cache a prefix of them
    assert decoder.target.length == len(tokens) - 1
    with torch.inference_mode():
        cached = decoder.target.forward(torch.tensor(tokens[-1:])).logits[-1]
        draft_runner = decoder.pair.draft
        draft_cached = draft_runner.forward(torch.tensor(tokens[draft_runner.length:])).logits[-1]
    torch.testing.assert_close(cached, _fresh_next_logits(decoder.pair.target_name, tokens), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(draft_cached, _fresh_next_logits(decoder.pair.draft_name, tokens), atol=1e-4,
                               rtol=1e-4)
    gen.close()


def test_events_are_consistent(decoder):
    config = GenerationConfig(method="draft", k=4, sampling=SamplingParams(0.8, 0, 0.9), max_new_tokens=30,
                              seed=1)
    events = list(decoder.generate(PROMPT, config))
    total = sum(len(e.emitted_ids) for e in events)
    assert total == 30 and events[-1].finished and events[-1].finish_reason == "length"
    for e in events:
        assert e.position == sum(len(x.emitted_ids) for x in events[:e.round])
        accepted = [t for t in e.drafted if t.accepted]
        assert len(accepted) == e.accepted_count
        assert all(t.tested for t in accepted)
        if not e.finished:
            assert e.emitted_ids == [t.token_id for t in accepted] + [e.next_token_id]
        for t in e.drafted:
            if t.tested:
                assert t.accept_prob == pytest.approx(min(1.0, t.p / t.q), abs=1e-6)
                assert (t.u < t.accept_prob) == t.accepted
        assert e.next_is_bonus == (e.accepted_count == len(e.drafted))
    m = events[-1].metrics
    assert m.rounds == len(events)
    assert m.drafted == sum(len(e.drafted) for e in events)
    assert m.accepted == sum(e.accepted_count for e in events)
    assert m.acceptance_rate == pytest.approx(m.accepted / m.drafted)
    assert m.mean_acceptance_length == pytest.approx(1 + m.accepted / m.rounds)
    assert m.tokens_per_forward == pytest.approx(30 / m.rounds)
    assert "".join(e.emitted_text for e in events) == decoder.tokenizer.decode(
        [t for e in events for t in e.emitted_ids], skip_special_tokens=True)


def test_seed_makes_sampling_reproducible(decoder):
    config = GenerationConfig(method="draft", k=3, sampling=SamplingParams(1.0, 20, 0.95), max_new_tokens=25,
                              seed=7)
    first = decoder.generate_ids(PROMPT, config)
    assert decoder.generate_ids(PROMPT, config) == first
    others = {tuple(decoder.generate_ids(PROMPT, GenerationConfig(
        method="draft", k=3, sampling=SamplingParams(1.0, 20, 0.95), max_new_tokens=25, seed=s)))
        for s in range(5)}
    assert len(others) > 1


def test_stop_at_eos(tmp_path, monkeypatch):
    """A target that always prefers </s> stops after one token, and the EOS is the last emitted token."""
    from engine.models.runner import ForwardOutput

    path = make_tiny_llama(tmp_path / "eos", seed=5)
    pair = load_pair(str(path), None, device="cpu", need_draft=False)
    eos = pair.tokenizer.eos_token_id
    forward = pair.target.forward

    def eos_loving_forward(tokens, parents=None):
        out = forward(tokens, parents)
        logits = out.logits.clone()
        logits[:, eos] += 1000.0
        return ForwardOutput(logits, out.hidden)

    monkeypatch.setattr(pair.target, "forward", eos_loving_forward)
    events = list(SpeculativeDecoder(pair).generate(PROMPT,
                                                    GenerationConfig(method="ngram", max_new_tokens=20)))
    assert events[-1].finish_reason == "eos" and events[-1].emitted_ids[-1] == eos
    assert sum(len(e.emitted_ids) for e in events) == 1


def test_stop_callback_ends_within_one_round(decoder):
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return calls["n"] > 2

    events = list(decoder.generate(PROMPT, GenerationConfig(method="draft", k=2, max_new_tokens=50),
                                   should_stop))
    assert len(events) == 2


def test_ngram_lookup():
    assert lookup_continuation([1, 2, 3, 4, 1, 2], 3, 2) == [3, 4]
    assert lookup_continuation([1, 2, 3, 4, 1, 2], 3, 8) == [3, 4, 1, 2]
    assert lookup_continuation([5, 6, 7], 3, 4) == []
    # the most recent occurrence wins, and longer suffixes first
    assert lookup_continuation([1, 9, 2, 1, 8, 2, 1], 2, 1) == [8]
    assert lookup_continuation([9, 1, 7, 5, 1, 8, 9, 1], 3, 1) == [7]


def test_context_overflow_is_a_clear_error(decoder):
    from engine.errors import SpecplayError

    with pytest.raises(SpecplayError, match="context"):
        list(decoder.generate(PROMPT, GenerationConfig(method="draft", k=4, max_new_tokens=10_000)))


def test_per_position_acceptance_and_histogram(close_decoder):
    events = list(close_decoder.generate(PROMPT, GenerationConfig(method="draft", k=4, max_new_tokens=40)))
    m = events[-1].metrics
    counts = [0] * 5
    for e in events:
        counts[e.accepted_count] += 1
    assert m.accepted_length_histogram == counts[:len(m.accepted_length_histogram)]
    assert sum(m.accepted_length_histogram) == m.rounds
    # alpha_0 = rounds whose first draft was accepted / rounds
    assert m.per_position_acceptance[0] == pytest.approx(sum(e.accepted_count > 0 for e in events) / m.rounds)
    reached_1 = [e for e in events if e.accepted_count >= 1]
    assert m.per_position_acceptance[1] == pytest.approx(
        sum(e.accepted_count > 1 for e in reached_1) / len(reached_1))
    assert m.draft_ms == pytest.approx(sum(e.draft_ms for e in events))


def test_nan_logits_are_a_clear_error(decoder, monkeypatch):
    from engine.errors import SpecplayError
    from engine.models.runner import ForwardOutput

    forward = decoder.target.forward

    def nan_forward(tokens, parents=None):
        out = forward(tokens, parents)
        return ForwardOutput(out.logits * float("nan"), out.hidden)

    monkeypatch.setattr(decoder.target, "forward", nan_forward)
    with pytest.raises(SpecplayError, match="NaN"):
        list(decoder.generate(PROMPT, GenerationConfig(method="ngram", max_new_tokens=5)))


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_pipelined_rounds_give_the_same_events(close_decoder, method, temperature):
    """The GPU's one-round pipelining (the next round queued before an event is built) changes no event:
    forced on here, on the CPU, it must reproduce the synchronous loop's tokens, verdicts and uniforms."""
    decoder = close_decoder
    config = GenerationConfig(method=method, k=4, sampling=SamplingParams(temperature), max_new_tokens=40,
                              seed=5)

    def run(pipelined):
        decoder.pipelined = pipelined
        try:
            return [(e.emitted_ids, e.accepted_count, [(t.token_id, t.u) for t in e.drafted], e.finish_reason)
                    for e in decoder.generate(PROMPT, config)]
        finally:
            decoder.pipelined = False

    assert run(True) == run(False)


@pytest.mark.parametrize("method", ["none", "draft"])
def test_pipelined_rounds_stop_when_asked(close_decoder, method):
    """Plain decoding keeps two rounds in flight; a stop still shows no round after it."""
    decoder = close_decoder
    decoder.pipelined = True
    try:
        rounds = 0

        def stop():
            return rounds >= 3

        for _ in decoder.generate(PROMPT, GenerationConfig(method=method, k=2, max_new_tokens=60), stop):
            rounds += 1
    finally:
        decoder.pipelined = False
    assert rounds == 3


def test_plain_decoding_ahead_respects_the_budget_and_timing(close_decoder):
    """Two plain rounds in flight: exactly max-new-tokens tokens, and round times that do not overlap (a
    round queued before the last one ended starts its clock at that end), so they add up to no more than
    the wall."""
    import time

    decoder = close_decoder
    decoder.pipelined = True
    try:
        began = time.perf_counter()
        events = list(decoder.generate(PROMPT, GenerationConfig(method="none", max_new_tokens=17)))
        wall_ms = 1000.0 * (time.perf_counter() - began)
    finally:
        decoder.pipelined = False
    assert sum(len(e.emitted_ids) for e in events) == 17 and events[-1].finish_reason == "length"
    assert 0 < sum(e.round_ms for e in events) <= wall_ms
