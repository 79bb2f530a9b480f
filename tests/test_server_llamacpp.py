"""The served-engine path against the real llama.cpp llama-server (a test-only peer, built by
scripts/peers/build_llama_server.sh) serving the shipped pair as f32 GGUF on loopback ports: speculation on
and off (a speculating and a plain server), a K sweep (one server per K: this llama.cpp takes K at its
start), 1-4 concurrent clients, the equality check, and its per-position counters from /metrics against the
tokens received. Skipped only where the peer is not built and --require-peers is not given (.ci/run builds
it and gives it)."""
from __future__ import annotations

import json

import pytest
from llama_peer import llama_server, missing

from engine.cli.main import main
from engine.sources import tuning
from engine.sources.server import ServedEngine, ServedRequest

PROMPT = "def fibonacci(n):\n    "
TOKENS = 48


@pytest.fixture(scope="module")
def peer(request):
    absent = missing()
    if absent:
        if request.config.getoption("--require-peers"):
            pytest.fail(f"the llama-server peer is not built ({absent[0]} is missing): run "
                        "scripts/peers/build_llama_server.sh")
        pytest.skip(f"llama-server peer not built ({absent[0]} missing; scripts/peers/build_llama_server.sh "
                    "builds it)")


@pytest.fixture(scope="module")
def engine(peer):
    with llama_server(k=4) as url:
        yield ServedEngine.connect(url)


@pytest.fixture(scope="module")
def plain(peer):
    with llama_server(k=0) as url:
        yield ServedEngine.connect(url)


def _request(**kw) -> ServedRequest:
    return ServedRequest(prompt=PROMPT, max_tokens=TOKENS, **kw)


def test_detected_as_llamacpp_taking_k_at_its_start(engine, plain):
    assert engine.kind == plain.kind == "llama.cpp"
    assert not engine.per_request_k  # this build takes K (--spec-draft-n-max) at its start only


def test_on_off_and_equality(engine, plain):
    arms = tuning.Arms(engine, plain)
    row = tuning.on_off(arms, _request())
    assert row["equal"], "greedy text with speculation on differs from off"
    on, off = row["on"], row["off"]
    assert on["tokens"] == off["tokens"] == TOKENS
    assert on["k"] == 4 and on["draft_tokens"] > 0 and on["drafts"] > 0 and 0.0 < on["alpha"] <= 1.0
    assert not off["draft_tokens"]
    check = tuning.check_equal(arms, _request())
    assert check["equal"] and check["diverges_at"] is None


def test_served_text_equals_the_local_engine(plain, capsys):
    served = tuning.served_once(plain, _request(), scrape=False)
    assert main(["run", "--method", "none", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--json",
                 "--device", "cpu"]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert served.text == local["text"]


def test_k_sweep_one_server_per_k(plain, peer):
    reference = tuning.served_once(plain, _request(), scrape=False).text
    for k in (1, 2, 8):
        with llama_server(k=k) as url:
            result = tuning.served_once(ServedEngine.connect(url), _request())
        figures = result.figures()
        assert result.text == reference
        assert figures["k"] == k and figures["drafts"] > 0
        assert figures["draft_tokens"] <= k * figures["drafts"]
        assert len(figures["per_position_acceptance"]) <= k
        if k == 1:
            assert figures["draft_tokens"] == figures["drafts"]  # one drafted token a step


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_concurrent_clients_give_the_same_text(engine, clients):
    alone = tuning.served_once(engine, _request(), scrape=False)
    row = tuning.concurrent(engine, _request(), clients)
    assert row["clients"] == clients and row["tokens"] == clients * TOKENS
    assert all(text == alone.text for text in row["texts"])
    assert row["alpha"] is not None and 0.0 < row["alpha"] <= 1.0


def test_per_position_counters_match_the_rounds_received(engine):
    generation = engine.generation(_request())
    events = list(generation)
    counters = generation.result.counters
    received = sum(len(e.emitted_ids) for e in events)
    assert received == TOKENS == generation.result.tokens
    drafting = [e for e in events if e.drafted]
    assert counters.drafts == len(drafting)  # each verification step is one round of the stream
    assert counters.draft_tokens == sum(len(e.drafted) for e in drafting)
    assert counters.accepted == sum(e.accepted_count for e in events)
    from_rounds = [sum(e.accepted_count > i for e in drafting) for i in range(4)]
    assert counters.accepted_per_position[:4] == from_rounds
    assert sum(counters.accepted_per_position) == counters.accepted
    # tokens received = every round's accepted drafts + its one token from the target, but the last round,
    # which max_tokens may cut short of what its step accepted
    assert all(len(e.emitted_ids) == e.accepted_count + 1 for e in events[:-1])
    assert 1 <= len(events[-1].emitted_ids) <= events[-1].accepted_count + 1
