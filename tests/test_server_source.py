"""Served engines (engine/sources): the counter parsers against the engines' documented formats (fixture texts
written by hand from llama.cpp's server-task.cpp, vLLM's and SGLang's metric docs), the chunk -> round stream
against a fake llama-server on loopback, the failure modes, the exports and the CLI."""
from __future__ import annotations

import csv
import json

import pytest
from fake_llama_server import PATTERN, FakeServer, expected_text

from engine.cli.main import main
from engine.files.trace import read_trace
from engine.sources import counters as spec
from engine.sources import tuning
from engine.sources.http import ServerError, parse_url
from engine.sources.server import ServedEngine, ServedRequest, detect_kind

LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 12
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 40
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 17
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 10
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 123.5
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 5
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 3
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 1
"""

# vLLM v1 (docs: "Production metrics", spec decode counters; prometheus_client adds _total to counters)
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 33.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 7.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_llamacpp_metrics_parse_to_alpha_and_per_position():
    c = spec.llamacpp_metrics(LLAMACPP_METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (10, 40, 17)
    assert c.accepted_per_position == [8, 5, 3, 1]
    assert c.acceptance_rate == pytest.approx(17 / 40)
    # a draft reaches position i when it accepted at every earlier one
    assert c.per_position_acceptance() == pytest.approx([8 / 10, 5 / 8, 3 / 5, 1 / 3])


def test_vllm_metrics_differences_between_scrapes():
    before = spec.vllm_metrics(VLLM_METRICS)
    after = spec.vllm_metrics(VLLM_METRICS.replace("} 20.0", "} 24.0").replace("} 60.0", "} 72.0")
                              .replace("} 33.0", "} 40.0").replace('"0"} 15.0', '"0"} 19.0'))
    assert (before.drafts, before.draft_tokens, before.accepted) == (20, 60, 33)
    assert before.accepted_per_position == [15, 11, 7]
    delta = after.minus(before)
    assert (delta.drafts, delta.draft_tokens, delta.accepted) == (4, 12, 7)
    assert delta.accepted_per_position == [4, 0, 0]
    assert delta.acceptance_rate == pytest.approx(7 / 12)


def test_sglang_meta_info_and_llamacpp_timings():
    c = spec.sglang_counters({"text": "x", "meta_info": {"completion_tokens": 30, "spec_accept_length": 2.5,
                                                         "spec_accept_rate": 0.6, "spec_verify_ct": 12}})
    assert (c.accept_length, c.acceptance_rate, c.drafts) == (2.5, 0.6, 12)
    assert spec.sglang_counters({"meta_info": {"completion_tokens": 3}}) is None
    t = spec.llamacpp_timings({"timings": {"predicted_n": 9, "predicted_ms": 4.5, "draft_n": 8,
                                           "draft_n_accepted": 3}})
    assert (t.predicted_n, t.draft_n, t.draft_n_accepted) == (9, 8, 3)
    assert spec.llamacpp_timings({"timings": {"predicted_n": 2}}).draft_n == 0  # absent: nothing drafted


@pytest.mark.parametrize("text", ["llamacpp:x{position=0} 1\n", "llamacpp:x one\n", "<html>\n",
                                  "a b c d e\n"])
def test_malformed_metrics_are_refused(text):
    with pytest.raises(spec.MetricsFormatError):
        spec.parse_prometheus(text)


def test_urls():
    assert parse_url("127.0.0.1:8080/v1").label == "http://127.0.0.1:8080"
    assert parse_url("http://h/prefix/v1/").base_path == "/prefix"
    for bad in ("ftp://h", "http://", "http://h:notaport"):
        with pytest.raises(ServerError):
            parse_url(bad)


# ------------------------------------------------------------------------------------------ against the fake
def _rounds(server: FakeServer, **request):
    engine = ServedEngine.connect(server.url)
    generation = engine.generation(ServedRequest(prompt="p", **request))
    return engine, list(generation), generation.result


def test_detects_llamacpp_and_streams_rounds_by_its_counters():
    with FakeServer() as server:
        engine, events, result = _rounds(server, max_tokens=24, k=4)
        assert engine.kind == "llama.cpp"
        assert detect_kind(parse_url(server.url)) == "llama.cpp"
        steps = list(server.state.steps)
        body = server.state.requests[-1]
    assert body["stream"] and body["speculative.n_max"] == 4 and body["timings_per_token"]
    assert result.text == expected_text(24) == "".join(e.emitted_text for e in events)
    # round 0 is the prefill's token; then one round per verification step the fake made
    assert [(len(e.drafted), e.accepted_count) for e in events[1:]] == steps
    assert [len(e.emitted_ids) for e in events[1:]] == [a + 1 for _, a in steps]
    assert [a for _, a in steps][:3] == PATTERN[:3]
    last = events[-1]
    assert last.finish_reason == "length" and last.metrics.emitted == 24
    assert last.metrics.accepted == sum(a for _, a in steps) == result.counters.accepted
    assert result.counters.drafts == len(steps)
    assert result.figures()["alpha"] == pytest.approx(sum(a for _, a in steps) / (4 * len(steps)))
    # what the server did not reveal is unknown, never 0
    assert all(d.p is None and d.q is None and d.token_id == -1 for e in events for d in e.drafted)
    assert "p" in last.unknown and "phase_times" in last.unknown and "drafted" not in last.unknown


def test_drafting_off_per_request_and_k_sweep():
    with FakeServer() as server:
        engine, events, result = _rounds(server, max_tokens=10, speculate=False)
        assert server.state.requests[-1]["speculative.n_max"] == 0
        assert all(not e.drafted and len(e.emitted_ids) == 1 for e in events) and len(events) == 10
        arms = tuning.Arms(engine)
        rows = tuning.k_sweep(arms, ServedRequest(prompt="p", max_tokens=20), [1, 2])
    assert [r["k"] for r in rows] == [1, 2] and all(r["equal"] for r in rows)
    assert rows[0]["draft_tokens"] == rows[0]["drafts"]  # K = 1: one token a draft
    assert rows[1]["draft_tokens"] == 2 * rows[1]["drafts"]
    assert len(rows[0]["per_position_acceptance"]) == 1


def test_concurrent_clients_add_up():
    with FakeServer() as server:
        arms = tuning.Arms(ServedEngine.connect(server.url))
        rows = tuning.client_sweep(arms, ServedRequest(prompt="p", max_tokens=12), [1, 3])
    assert [r["clients"] for r in rows] == [1, 3] and all(r["equal"] for r in rows)
    assert all(r["on_tokens_per_s"] > 0 and r["off_tokens_per_s"] > 0 for r in rows)


def test_csv_and_trace_of_served_rounds(tmp_path):
    with FakeServer() as server:
        code = main(["run", "--server", server.url, "--prompt", "p", "--max-new-tokens", "12",
                     "--csv", str(tmp_path / "m.csv"), "--trace", str(tmp_path / "t.jsonl")])
    assert code == 0
    rows = list(csv.DictReader(open(tmp_path / "m.csv", encoding="utf-8")))
    assert sum(int(r["emitted [tokens]"]) for r in rows) == 12
    assert all(r["draft_ms [ms]"] == "" and r["verify_ms [ms]"] == "" and float(r["round_ms [ms]"]) >= 0
               for r in rows)
    assert any(int(r["accepted [tokens]"]) > 0 for r in rows)
    runs = read_trace(tmp_path / "t.jsonl")
    assert runs[0].header["served"].startswith("llama.cpp http://127.0.0.1:")
    assert "".join(e.emitted_text for e in runs[0].events) == expected_text(12)
    assert runs[0].events[-1].unknown and runs[0].events[-1].served


def test_a_local_round_may_not_claim_unknown_figures(tmp_path):
    with FakeServer() as server:
        main(["run", "--server", server.url, "--prompt", "p", "--max-new-tokens", "4",
              "--trace", str(tmp_path / "t.jsonl")])
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    record["served"] = ""
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + json.dumps(record) + "\n")
    with pytest.raises(Exception, match="unknown|token_id|emitted_ids"):
        read_trace(tmp_path / "bad.jsonl")


# ------------------------------------------------------------------------------------------ bad servers
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_unreachable_server(capsys):
    line = _cli_error(capsys, ["run", "--server", f"http://127.0.0.1:{_free_port()}", "--prompt", "p"])
    assert "unreachable" in line


@pytest.mark.parametrize("mode, kind, words", [
    ("html", "openai", "not an OpenAI"), ("html", "llama.cpp", "not Prometheus"),
    ("not-sse", "llama.cpp", "event stream"), ("no-metrics", "llama.cpp", "HTTP 501: no metrics"),
    ("bad-metrics", "llama.cpp", "not Prometheus")])
def test_bad_replies_are_one_line(capsys, mode, kind, words):
    with FakeServer(mode) as server:
        line = _cli_error(capsys, ["run", "--server", server.url, "--server-kind", kind,
                                   "--prompt", "p", "--max-new-tokens", "6"])
    assert words in line


def test_a_server_that_says_nothing_is_a_plain_openai_one():
    with FakeServer("html") as server:
        assert detect_kind(parse_url(server.url)) == "openai"


def test_cut_stream_keeps_the_rounds(capsys, tmp_path):
    with FakeServer("cut") as server:
        line = _cli_error(capsys, ["run", "--server", server.url, "--prompt", "p", "--max-new-tokens", "20",
                                   "--trace", str(tmp_path / "t.jsonl")])
    assert "cut off" in line and "rounds kept" in line
    events = read_trace(tmp_path / "t.jsonl")[0].events
    assert 0 < sum(len(e.emitted_ids) for e in events) <= 10
    assert events[-1].finish_reason == "error"


def test_slow_server_times_out(capsys):
    with FakeServer("slow") as server:
        line = _cli_error(capsys, ["run", "--server", server.url, "--server-timeout", "0.5", "--prompt", "p",
                                   "--max-new-tokens", "8"])
    assert "timeout" in line


def test_engines_that_take_k_at_start_refuse_a_per_request_k():
    with FakeServer() as server:
        engine = ServedEngine.connect(server.url, "vllm")
        with pytest.raises(ServerError, match="takes K at its start"):
            engine.generation(ServedRequest(prompt="p", k=4))
        with pytest.raises(ServerError, match="plain-server"):
            tuning.Arms(engine)


def test_bench_server_cli(capsys):
    with FakeServer() as server:
        code = main(["bench", "server", "--server", server.url, "--prompt", "p", "--max-new-tokens", "12",
                     "--k-sweep", "1,3", "--clients", "1,2", "--check-equal"])
    out = capsys.readouterr().out
    assert code == 0 and "equality: PASS" in out and "on/off (K=4)" in out
    assert main(["bench", "server", "--prompt", "p"]) == 2


def test_server_options_that_do_not_combine(capsys, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    line = _cli_error(capsys, ["run", "--server", "http://127.0.0.1:9", "--prompts-file", str(prompts)])
    assert "--prompts-file" in line
    line = _cli_error(capsys, ["bench", "methods", "--server", "http://127.0.0.1:9", "--prompt", "p"])
    assert "bench methods" in line
    line = _cli_error(capsys, ["bench", "server", "--server", "http://127.0.0.1:9", "--clients", "0,2"])
    assert "--clients" in line or "unreachable" in line


def test_a_server_that_takes_k_at_its_start_needs_a_plain_server():
    with FakeServer("fixed-k", default_k=3) as server, FakeServer(default_k=0) as plain:
        engine = ServedEngine.connect(server.url)
        assert engine.kind == "llama.cpp" and not engine.per_request_k
        with pytest.raises(ServerError, match="plain-server"):
            tuning.Arms(engine)
        with pytest.raises(ServerError, match="--spec-draft-n-max"):
            engine.generation(ServedRequest(prompt="p", k=4))
        plain_engine = ServedEngine.connect(plain.url)
        arms = tuning.Arms(engine, plain_engine)
        with pytest.raises(ServerError, match="restarting it with each K"):
            tuning.k_sweep(arms, ServedRequest(prompt="p", max_tokens=8), [1, 2])
        row = tuning.on_off(arms, ServedRequest(prompt="p", max_tokens=16))
    assert row["equal"] and row["on"]["k"] == 3  # the server's own K, seen in its rounds
    assert row["on"]["draft_tokens"] > 0 and row["off"]["draft_tokens"] in (0, None)
    assert "speculative.n_max" not in server.state.requests[-1]
