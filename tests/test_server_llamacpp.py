"""The served-engine path against the real llama.cpp llama-server (a test-only peer, built by
scripts/peers/build_llama_server.sh) serving the shipped pair as f32 GGUF on a loopback port: speculation on
and off, a K sweep, 1-4 concurrent clients, the equality check, and its per-position counters from /metrics
against the tokens received. Skipped only where the peer is not built and --require-peers is not given
(.ci/run builds it and gives it)."""
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
def server_url(request):
    absent = missing()
    if absent:
        if request.config.getoption("--require-peers"):
            pytest.fail(f"the llama-server peer is not built ({absent[0]} is missing): run "
                        "scripts/peers/build_llama_server.sh")
        pytest.skip(f"llama-server peer not built ({absent[0]} missing; scripts/peers/build_llama_server.sh "
                    "builds it)")
    with llama_server() as url:
        yield url


@pytest.fixture(scope="module")
def engine(server_url):
    return ServedEngine.connect(server_url)


def _request(**kw) -> ServedRequest:
    return ServedRequest(prompt=PROMPT, max_tokens=TOKENS, **kw)


def test_detected_as_llamacpp(engine):
    assert engine.kind == "llama.cpp"


def test_on_off_and_equality(engine):
    arms = tuning.Arms(engine)
    row = tuning.on_off(arms, _request(k=4))
    assert row["equal"], "greedy text with speculation on differs from off"
    on, off = row["on"], row["off"]
    assert on["tokens"] == off["tokens"] == TOKENS
    assert on["draft_tokens"] > 0 and on["drafts"] > 0 and 0.0 < on["alpha"] <= 1.0
    assert off["draft_tokens"] == 0  # n_max 0 turns drafting off for that request
    check = tuning.check_equal(arms, _request(k=4))
    assert check["equal"] and check["diverges_at"] is None


def test_served_text_equals_the_local_engine(engine, capsys):
    served = tuning.served_once(engine, _request(speculate=False), scrape=False)
    assert main(["run", "--method", "none", "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--json",
                 "--device", "cpu"]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert served.text == local["text"]


def test_k_sweep_takes_k_per_request(engine):
    rows = tuning.k_sweep(tuning.Arms(engine), _request(), [1, 2, 4])
    for row in rows:
        assert row["equal"]
        assert row["drafts"] > 0 and row["draft_tokens"] <= row["k"] * row["drafts"]
        assert len(row["per_position_acceptance"]) <= row["k"]
    assert rows[0]["draft_tokens"] == rows[0]["drafts"]  # K = 1: one drafted token a step


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_concurrent_clients_give_the_same_text(engine, clients):
    alone = tuning.served_once(engine, _request(k=4), scrape=False)
    row = tuning.concurrent(engine, _request(k=4), clients)
    assert row["clients"] == clients and row["tokens"] == clients * TOKENS
    assert all(text == alone.text for text in row["texts"])
    assert row["alpha"] is not None and 0.0 < row["alpha"] <= 1.0


def test_per_position_counters_match_the_rounds_received(engine):
    generation = engine.generation(_request(k=4))
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
    # tokens received = the prefill's token + every round's accepted + 1
    assert received == 1 + sum(e.accepted_count + 1 for e in events[1:])
