"""One source of metrics: plots, bench, the CLI summary and the CSV read RoundMetrics
(engine/core/metrics.py).

Each consumer is checked against a run recorded on tiny models, and RoundMetrics itself against a recount."""
import csv
import math
from dataclasses import asdict, replace

import pytest
from spec_fixtures import make_close_decoder

from engine.bench import suite as bench
from engine.cli.main import summarize
from engine.config import GenerationConfig, SamplingParams
from engine.core.metrics import (
    RunTotals,
    csv_header,
    final_metrics,
    histogram_bars,
    round_acceptance,
    round_depth,
    round_tokens,
    round_tpot_ms,
    write_csv,
)
from engine.events import RoundMetrics

PROMPTS = ["the cat sat on the mat. the cat sat on the", "a b a b a b a"]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A draft close to the target: rounds accept some drafts, not all."""
    return make_close_decoder(tmp_path_factory.mktemp("metrics"))


def tree_or_skip(decoder, name):
    reason = decoder.method_availability().get(name)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")


CONFIGS = {
    "draft": GenerationConfig(method="draft", k=4, max_new_tokens=40, sampling=SAMPLED, seed=2),
    "ngram": GenerationConfig(method="ngram", k=3, max_new_tokens=30),
    "lookahead": GenerationConfig(method="lookahead", k=3, max_new_tokens=30),
    "none": GenerationConfig(method="none", max_new_tokens=12),
}


@pytest.fixture(params=list(CONFIGS))
def recorded(request, decoder):
    """(config, events) of one generation."""
    config = CONFIGS[request.param]
    if config.method == "lookahead":
        tree_or_skip(decoder, "lookahead")
    return config, list(decoder.generate(PROMPTS[0], config))


def recount(events):
    """Per-position acceptance and the accepted-length histogram counted by hand from the events."""
    reached, accepted, lengths = [], [], []
    for e in events:
        depth = round_depth(e)
        reached += [0] * (depth - len(reached))
        accepted += [0] * (depth - len(accepted))
        for d in range(min(depth, e.accepted_count + 1)):
            reached[d] += 1
            accepted[d] += int(e.accepted_count > d)
        lengths += [0] * (e.accepted_count + 1 - len(lengths))
        lengths[e.accepted_count] += 1
    return [a / r if r else 0.0 for a, r in zip(accepted, reached)], lengths


def test_round_metrics_match_a_recount(recorded):
    _, events = recorded
    m = final_metrics(events)
    alphas, lengths = recount(events)
    assert m.per_position_acceptance == pytest.approx(alphas)
    assert m.accepted_length_histogram == lengths
    assert m.rounds == len(events) and m.emitted == sum(len(e.emitted_ids) for e in events)
    assert m.drafted == sum(len(e.drafted) for e in events)
    assert m.accepted == sum(e.accepted_count for e in events)
    assert m.draft_ms + m.verify_ms + m.overhead_ms == pytest.approx(sum(e.round_ms for e in events))


def test_plot_buffers_show_what_round_metrics_say(recorded):
    from app.plot_data import PlotBuffers

    _, events = recorded
    buffers = PlotBuffers()
    for e in events:
        buffers.add(e)
    m = final_metrics(events)
    assert buffers.per_position_acceptance == m.per_position_acceptance
    assert buffers.length_counts == histogram_bars(m)
    assert buffers.length_counts[:len(m.accepted_length_histogram)] == m.accepted_length_histogram
    assert len(buffers.length_counts) == 1 + max(round_depth(e) for e in events)
    assert buffers.running_tpf == [e.metrics.tokens_per_forward for e in events]
    assert buffers.running_tpot == [e.metrics.tpot_ms for e in events]
    assert buffers.round_tpf == [float(len(e.emitted_ids)) for e in events]
    for e, alpha in zip(events, buffers.round_alpha):
        depth = round_depth(e)
        assert (math.isnan(alpha) and depth == 0) or alpha == e.accepted_count / depth


def test_per_round_values():
    from engine.events import DraftedToken, RoundEvent

    def token(depth, parent):
        return DraftedToken(0, "x", parent, depth, 0.5, 0.5, 1.0, None, False, False)

    tree = [token(0, -1), token(0, -1), token(1, 0), token(2, 2)]  # 4 nodes, 3 positions deep
    event = RoundEvent(0, "lookahead", 3, tree, 2, 1, "y", False, 0.5, [], [5, 6, 7], "", 0, 1.0, 2.0, 0.5,
                       False, None, RoundMetrics.empty())
    assert round_depth(event) == 3 and round_acceptance(event) == pytest.approx(2 / 3)
    assert round_tokens(event) == 3.0 and round_tpot_ms(event) == pytest.approx(3.5 / 3)
    plain = replace(event, drafted=[], accepted_count=0, emitted_ids=[5])
    assert round_depth(plain) == 0 and math.isnan(round_acceptance(plain)) and round_tpot_ms(plain) == 3.5


def test_histogram_bars_reach_the_deepest_draft():
    m = replace(RoundMetrics.empty(), per_position_acceptance=[0.5, 0.2, 0.0, 0.0],
                accepted_length_histogram=[3, 2])
    assert histogram_bars(m) == [3, 2, 0, 0, 0]
    assert histogram_bars(RoundMetrics.empty()) == [0]


def test_one_generation_of_run_totals_is_its_round_metrics(recorded):
    config, events = recorded
    m = final_metrics(events)
    totals = RunTotals(config.drafts)
    totals.add(m)
    for name in ("rounds", "drafted", "accepted", "emitted", "draft_ms", "verify_ms", "overhead_ms"):
        assert getattr(totals, name) == getattr(m, name), name
    for name in ("acceptance_rate", "mean_acceptance_length", "tokens_per_forward", "tpot_ms", "tokens_per_s",
                 "analytic_tokens_per_forward"):
        assert getattr(totals, name) == pytest.approx(getattr(m, name)), name
    assert totals.length_histogram == m.accepted_length_histogram


class Recording:
    """The decoder, keeping every generation's events."""

    def __init__(self, decoder):
        self.decoder, self.runs = decoder, []

    def generate(self, prompt, config, should_stop=None):
        self.runs.append(list(self.decoder.generate(prompt, config, should_stop)))
        yield from self.runs[-1]


def test_bench_measure_adds_up_the_generations_round_metrics(decoder):
    recording = Recording(decoder)
    totals = bench.measure(recording, PROMPTS, CONFIGS["draft"], repeats=2)
    finals = [final_metrics(events) for events in recording.runs]
    assert totals.generations == len(finals) == 2 * len(PROMPTS)
    for name in ("rounds", "drafted", "accepted", "emitted"):
        assert getattr(totals, name) == sum(getattr(m, name) for m in finals), name
    assert totals.acceptance_rate == sum(m.accepted for m in finals) / sum(m.drafted for m in finals)
    assert totals.tokens_per_forward == sum(m.emitted for m in finals) / sum(m.rounds for m in finals)
    assert totals.time_ms == pytest.approx(sum(m.draft_ms + m.verify_ms + m.overhead_ms for m in finals))
    assert totals.tokens_per_s == pytest.approx(1000 * totals.emitted / totals.time_ms)
    merged = [sum(col) for col in zip(*(m.accepted_length_histogram + [0] * 9 for m in finals))]
    assert totals.length_histogram == merged[:len(totals.length_histogram)]
    assert not any(merged[len(totals.length_histogram):])


def test_bench_methods_rows_read_run_totals(decoder, monkeypatch):
    recorded = {}
    measure = bench.measure_interleaved

    def spy(dec, prompts, configs, repeats=1, after=None, before_repeat=None, **options):
        totals = measure(dec, prompts, configs, repeats, after, before_repeat, **options)
        recorded.update(totals)
        return totals

    monkeypatch.setattr(bench, "measure_interleaved", spy)
    rows = bench.bench_methods(decoder, PROMPTS[:1], CONFIGS["ngram"], ["ngram"])
    assert [r["method"] for r in rows] == ["none", "ngram"]
    for row in rows:
        totals = recorded[row["method"]]
        assert row["alpha"] == totals.acceptance_rate and row["k"] == totals.k
        assert row["tokens_per_forward"] == totals.tokens_per_forward
        assert row["analytic_tokens_per_forward"] == totals.analytic_tokens_per_forward
        assert row["speedup"] == totals.tokens_per_s / recorded["none"].tokens_per_s
    assert rows[0]["k"] == 0 and rows[0]["analytic_tokens_per_forward"] == 1.0


def test_bench_methods_reports_progress_and_stops_when_told(decoder):
    """progress(done, total) after every generation, the warm-ups' included; False stops the run, which then
    gives no rows."""
    calls = []
    rows = bench.bench_methods(decoder, PROMPTS[:2], CONFIGS["ngram"], ["ngram"],
                               progress=lambda done, total: calls.append((done, total)))
    assert len(rows) == 2 and calls == [(i, 6) for i in range(1, 7)]  # 2 warm-ups, 2 methods x 2 prompts
    for stop_after in (1, 4):
        calls.clear()

        def until(done, total, last=stop_after):
            calls.append(done)
            return done < last

        stopped = bench.bench_methods(decoder, PROMPTS[:2], CONFIGS["ngram"], ["ngram"], progress=until)
        assert stopped == [] and calls == list(range(1, stop_after + 1))


def test_bench_methods_takes_specs_and_labels_them(decoder):
    tree_or_skip(decoder, "lookahead")
    base = replace(CONFIGS["ngram"], max_new_tokens=6)
    rows = bench.bench_methods(decoder, PROMPTS[:1], base, ["ngram", "lookahead:5"])
    assert [r["method"] for r in rows] == ["none", "ngram", "lookahead:5"]


OLD_SUMMARY_KEYS = {  # what `run --json` printed before the summary was built from RoundMetrics
    "method", "k", "tree_nodes", "temperature", "rounds", "drafted", "accepted", "emitted", "acceptance_rate",
    "mean_acceptance_length", "tokens_per_forward", "analytic_tokens_per_forward",
    "per_position_tokens_per_forward", "tpot_ms", "tokens_per_s", "per_position_acceptance",
    "accepted_length_histogram", "draft_ms", "verify_ms", "overhead_ms", "finish_reason"}


def test_summary_is_the_settings_and_round_metrics(recorded):
    config, events = recorded
    summary = summarize(events, config)
    assert set(summary) == OLD_SUMMARY_KEYS
    assert {k: summary[k] for k in asdict(events[-1].metrics)} == asdict(events[-1].metrics)
    assert summary["finish_reason"] == events[-1].finish_reason and summary["method"] == config.method


def test_summary_of_no_rounds_is_zeros():
    summary = summarize([], CONFIGS["draft"])
    assert set(summary) == OLD_SUMMARY_KEYS and summary["finish_reason"] is None
    assert summary["rounds"] == 0 and isinstance(summary["rounds"], int)
    assert summary["tpot_ms"] == 0.0 and isinstance(summary["tpot_ms"], float)
    assert summary["per_position_acceptance"] == [] and summary["accepted_length_histogram"] == []


def test_csv_rows_are_round_metrics(recorded, tmp_path):
    _, events = recorded
    path = tmp_path / "m.csv"
    assert write_csv(events, path) == len(events)
    rows = list(csv.reader(path.open()))
    header = rows[0]
    assert header == csv_header()
    for row, e in zip(rows[1:], events):
        for name in ("acceptance_rate", "tokens_per_forward", "tpot_ms", "analytic_tokens_per_forward"):
            cell = next(i for i, h in enumerate(header) if h.split(" [")[0] == "running_" + name)
            if row[cell] == "":  # plain decoding drafts nothing: it has no α
                assert name == "acceptance_rate" and e.metrics.drafted == 0
                continue
            assert float(row[cell]) == pytest.approx(getattr(e.metrics, name), rel=1e-5), name


def _totals(k, rounds, emitted, draft_ms, verify_ms, overhead_ms=0.0):
    totals = RunTotals(k)
    totals._add(rounds, k * rounds, emitted - rounds, emitted, draft_ms, verify_ms, overhead_ms,
                draft_ms + verify_ms + overhead_ms)
    return totals


def test_textbook_speedup_uses_the_runs_own_e_and_c():
    """Chains: E / (1 + cK) with c = a draft step over plain's verification step; trees: E * t_step / (the
    tree's drafting + its verification block)."""
    plain = _totals(0, 100, 100, 0.0, 400.0)  # a target step: 4 ms
    chain = _totals(4, 10, 30, 20.0, 45.0)  # E = 3, a draft step 0.5 ms: c = 0.125
    figures = bench.textbook(chain, plain, tree=False)
    assert figures["c"] == pytest.approx(0.125)
    assert figures["textbook_speedup"] == pytest.approx(3.0 / 1.5)
    tree = bench.textbook(chain, plain, tree=True)  # 2 ms drafting + 4.5 ms verification a round
    assert tree["c"] == pytest.approx(0.5) and tree["textbook_speedup"] == pytest.approx(3.0 * 4.0 / 6.5)
    assert bench.textbook(chain, _totals(0, 0, 0, 0.0, 0.0), tree=False) == {}


def test_bench_methods_rows_carry_the_textbook_share(decoder):
    rows = bench.bench_methods(decoder, PROMPTS[:1], CONFIGS["ngram"], ["ngram"])
    plain, ngram = rows
    assert "textbook_speedup" not in plain
    assert ngram["textbook_speedup"] > 0 and ngram["c"] >= 0
    assert ngram["textbook_share"] == pytest.approx(ngram["speedup"] / ngram["textbook_speedup"])
