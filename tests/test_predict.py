"""Per-depth acceptance, the geometric-law test and counterfactual K, on hand-made traces and a real one."""
import pytest
from trace_fixtures import chain_round, tree_round, write_trace

from engine.analysis import analytic
from engine.analysis.acceptance import RoundShape, geometric_test, wilson_interval
from engine.analysis.costmodel import CostModel, Measured
from engine.analysis.predict import (
    DraftOracle,
    load_trace,
    predict_from_trace,
    predict_tokens_per_forward,
    trace_from_events,
)
from engine.errors import SpecplayError


def bursty_chain(rounds=40, k=8, every=5) -> list:
    """All or nothing: one round in `every` accepts all K drafts, the others reject the first."""
    return [chain_round(i, k, k if i % every == 0 else 0) for i in range(rounds)]


def measured_tpf(records) -> float:
    return sum(len(r["emitted_ids"]) for r in records) / len(records)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0)


def test_per_depth_e_fits_a_bursty_chain_where_uniform_alpha_is_far_off(tmp_path):
    records = bursty_chain()
    trace = load_trace(write_trace(tmp_path / "t.jsonl", records))
    a = trace.acceptance()
    assert a.alphas == pytest.approx([0.2] + [1.0] * 7)
    assert a.expected(8) == pytest.approx(1 + 0.2 * 8) == pytest.approx(measured_tpf(records))
    raw_alpha = sum(r["accepted_count"] for r in records) / (8 * len(records))  # the chapter's alpha
    assert raw_alpha == pytest.approx(0.2)
    assert analytic.expected_tokens(raw_alpha, 8) < 0.5 * measured_tpf(records)
    test = geometric_test([r.shape for r in trace.rounds])
    assert not test.holds and test.p_value < 1e-6


def test_geometric_law_holds_on_geometric_lengths():
    # counts proportional to a truncated geometric law with alpha = 0.5 at K = 3: 1/2, 1/4, 1/8, 1/8
    shapes = [RoundShape(3, a) for a, n in ((0, 40), (1, 20), (2, 10), (3, 10)) for _ in range(n)]
    test = geometric_test(shapes)
    assert test.alpha == pytest.approx(0.5)
    assert test.holds and test.p_value > 0.9


def test_tree_per_depth_e_equals_measured_tokens_per_forward(tmp_path):
    # two roots, each with children; accepted paths of length 2, 0, 3, 1
    parents = [-1, -1, 0, 0, 1, 2]
    paths = [[0, 2], [], [0, 2, 5], [1]]
    records = [tree_round(i, parents, path, k=3) for i, path in enumerate(paths)]
    trace = load_trace(write_trace(tmp_path / "tree.jsonl", records))
    assert trace.is_tree
    a = trace.acceptance()
    assert a.reached == [4, 3, 2] and a.accepted == [3, 2, 1]  # three depths
    assert a.expected(3) == pytest.approx(measured_tpf(records))
    per_node = sum(len(p) for p in paths) / (len(parents) * len(paths))  # alpha per node, the raw rate
    assert analytic.expected_tokens(per_node, 3) < 0.7 * measured_tpf(records)
    tpf, basis = predict_tokens_per_forward(trace, 3)
    assert tpf == pytest.approx(measured_tpf(records)) and "per-depth" in basis


def test_trace_reader_skips_header_and_accepts_untyped_rounds(tmp_path):
    records = bursty_chain(rounds=4)
    del records[1]["type"]
    records.insert(2, {"type": "note", "text": "ignored"})
    path = write_trace(tmp_path / "t.jsonl", records, header={"config": {"sampling": {"temperature": 0.8}}})
    trace = load_trace(path)
    assert len(trace.rounds) == 4 and not trace.greedy
    assert trace.sampling.temperature == 0.8  # calibration times rounds sampled like the run's
    (tmp_path / "empty.jsonl").write_text('{"type": "header"}\n')
    with pytest.raises(SpecplayError, match="no rounds"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    with pytest.raises(SpecplayError, match="bad.jsonl, line 1"):
        load_trace(tmp_path / "bad.jsonl")


def test_oracle_knows_the_draft_inside_accepted_runs():
    # output 10 11 12 | 20 21 ...: round 0 drafted 10 11 99 (2 accepted, correction 12)
    rounds = trace_from_events([chain_round(0, 3, 2, drafted_ids=[10, 11, 99], next_id=12),
                                chain_round(1, 3, 3, drafted_ids=[20, 21, 22], next_id=23),
                                chain_round(2, 3, 0, drafted_ids=[98, 1, 1], next_id=30)]).generations[0]
    oracle = DraftOracle(rounds)
    assert oracle.output == [10, 11, 12, 20, 21, 22, 23, 30]
    assert [oracle.agrees(p) for p in range(8)] == [True, True, False, True, True, True, None, False]
    assert oracle.exact_accepted(0, 1) == 1 and oracle.exact_accepted(0, 5) == 2
    assert oracle.exact_accepted(1, 2) == 1
    assert oracle.exact_accepted(3, 3) == 3  # K' = 3 stops before the unknown bonus position
    assert oracle.exact_accepted(3, 4) is None


def test_counterfactual_speedups_use_the_cost_model():
    trace = trace_from_events(bursty_chain())
    costs = CostModel(verify={1: Measured(1.0), 9: Measured(1.8)}, draft_step={"draft": Measured(0.1)},
                      overhead={"none": Measured(0.0), "draft": Measured(0.2)})
    report = predict_from_trace(trace, [1, 4, 8], costs)
    p8 = next(p for p in report.predictions if p.k == 8)
    assert p8.tokens_per_forward == pytest.approx(2.6, rel=0.02)
    refitted = report.costs  # the trace's own times (verify 2.0 at block 9, draft 1.0 / 8 a step) took over
    assert refitted.t_verify(9) == pytest.approx(2.0)
    assert refitted.draft_step["draft"].median == pytest.approx(0.125)
    assert p8.round_ms == pytest.approx(0.125 * 8 + 2.0 + 0.2)
    assert p8.speedup == pytest.approx(refitted.t_plain / (p8.round_ms / p8.tokens_per_forward))
    assert report.best.k in (1, 4, 8)


# ------------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def close_decoder(tmp_path_factory):
    from spec_fixtures import make_close_decoder

    return make_close_decoder(tmp_path_factory.mktemp("close"))


PROMPT = "the cat sat on the mat. the cat sat on the"


def test_exact_counterfactual_agrees_with_real_runs(close_decoder):
    from engine.config import GenerationConfig

    source = list(close_decoder.generate(PROMPT, GenerationConfig(method="draft", k=8, max_new_tokens=80)))
    trace = trace_from_events(source)
    oracle = DraftOracle(trace.generations[0])
    determined = total = 0
    for k in (1, 2, 3, 5, 8):
        real = list(close_decoder.generate(PROMPT, GenerationConfig(method="draft", k=k, max_new_tokens=80)))
        assert [t for e in real for t in e.emitted_ids] == oracle.output  # lossless: one output for all K
        for event in real[:-1]:
            exact = oracle.exact_accepted(event.position, k)
            total += 1
            if exact is not None:
                determined += 1
                assert exact == event.accepted_count, (k, event.position)
        tpf, _ = predict_tokens_per_forward(trace, k)
        assert tpf == pytest.approx(len(oracle.output) / len(real), rel=0.1)
    assert determined >= 0.6 * total


def test_ngram_counterfactual_replays_the_lookup_exactly(close_decoder):
    from engine.config import GenerationConfig

    ids = close_decoder.tokenizer.encode(PROMPT)
    source = list(close_decoder.generate(PROMPT, GenerationConfig(method="ngram", k=8, max_new_tokens=60)))
    trace = trace_from_events(source)
    trace.header = {"prompt_ids": ids, "config": {"ngram_n": 3}}
    for k in (1, 3, 8):
        real = list(close_decoder.generate(PROMPT, GenerationConfig(method="ngram", k=k, max_new_tokens=60)))
        tpf, basis = predict_tokens_per_forward(trace, k)
        assert basis == "exact (replayed)"
        assert tpf == pytest.approx(sum(len(e.emitted_ids) for e in real) / len(real))
    for broken in ({}, {"prompt_ids": "abc"}, {"prompt_ids": [1, "2"]}, {"prompt_ids": [True, 2]}):
        trace.header = broken  # no ids, or not token ids: the model, never a replay of garbage
        assert "per-depth" in predict_tokens_per_forward(trace, 4)[1]


def test_a_saved_ngram_trace_of_two_generations_replays_each_from_its_own_prompt(close_decoder, tmp_path):
    """What the window and `run --trace` write (a header per generation with its settings and prompt ids)
    is what the prediction replays: every K's tokens per forward equals a real run's."""
    from engine.config import GenerationConfig
    from engine.files.exports import export_runs
    from engine.files.trace import Run, make_header

    prompts = (PROMPT, "a b c d a b c d a b")
    source = GenerationConfig(method="ngram", k=8, max_new_tokens=40)
    runs = [Run(header=make_header(prompt, source, generation=number,
                                   prompt_ids=close_decoder.prompt_ids(prompt)),
                events=list(close_decoder.generate(prompt, source)), finish="length")
            for number, prompt in enumerate(prompts, 1)]
    export_runs(tmp_path / "two.jsonl", "jsonl", runs)
    trace = load_trace(tmp_path / "two.jsonl")
    assert len(trace.generations) == 2 and trace.ngram_n == source.ngram_n
    for k in (1, 4):
        config = GenerationConfig(method="ngram", k=k, max_new_tokens=40)
        real = [e for prompt in prompts for e in close_decoder.generate(prompt, config)]
        tpf, basis = predict_tokens_per_forward(trace, k)
        assert basis == "exact (replayed)"
        assert tpf == pytest.approx(sum(len(e.emitted_ids) for e in real) / len(real))


def test_a_k_sweep_of_ngram_predicts_every_k_exactly_from_its_largest_k_run(close_decoder):
    from engine.bench.suite import bench_k_sweep
    from engine.config import GenerationConfig

    prompts = [PROMPT, "a b c d a b c d a b"]
    rows = bench_k_sweep(close_decoder, prompts, GenerationConfig(method="ngram", k=4, max_new_tokens=30),
                         (1, 2, 4))
    for row in rows:
        assert row["from_run_k"] == 4 and row["from_run_basis"] == "exact (replayed)"
        assert row["from_run_tokens_per_forward"] == pytest.approx(row["tokens_per_forward"])
    from engine.bench.suite import _generation_headers

    headers = _generation_headers(close_decoder, prompts, GenerationConfig(method="ngram"), 2)
    assert [h["prompt_ids"] for h in headers] == [close_decoder.prompt_ids(p) for p in prompts] * 2
    assert {h["models"]["target"] for h in headers} == {close_decoder.pair.target_name}  # whose table


def test_replayed_ngram_rounds_on_the_cpu_cost_what_they_propose(close_decoder):
    """On the CPU a round verifies only what n-gram proposed, so a K past the matches' length costs little
    more; on a GPU every round has its K + 1 rows."""
    from engine.analysis.predict import ngram_trace_replay, predict_ks
    from engine.config import GenerationConfig

    config = GenerationConfig(method="ngram", k=4, max_new_tokens=40)
    trace = trace_from_events(list(close_decoder.generate(PROMPT, config)))
    costs = CostModel(verify={1: Measured(1.0), 33: Measured(33.0)}, overhead={"ngram": Measured(0.0)})
    for device, cpu in (("CPU", True), ("NVIDIA H200", False)):
        trace.header = {"prompt_ids": close_decoder.prompt_ids(PROMPT), "settings": config.to_dict(),
                        "device": device}
        (p16,) = predict_ks(trace, [16], costs)
        blocks = [proposed + 1 for proposed, _ in ngram_trace_replay(trace, 16)]
        assert min(blocks) < 17  # some matches end before K = 16
        expected = sum(blocks) / len(blocks) if cpu else 17.0  # t_verify(n) = n ms on this curve
        assert p16.round_ms == pytest.approx(expected + costs.t_draft("ngram", 16))


def test_short_drafts_count_as_stopping_so_the_model_gives_the_runs_own_tokens_per_forward(tmp_path):
    """A lookup drafter proposes what its match holds: a round may draft fewer than K (or nothing) and
    accept all of it. The per-depth model must count where it stopped, or it predicts its own K too high."""
    lengths = [4, 2, 0, 1, 4, 3, 0, 2]  # drafted a round, every one accepted
    records = [chain_round(i, 4, n, method="ngram", drafted_ids=[100 + d for d in range(n)])
               for i, n in enumerate(lengths)]
    trace = load_trace(write_trace(tmp_path / "short.jsonl", records))
    tpf, basis = predict_tokens_per_forward(trace, 4)
    assert basis == "per-depth model"
    assert tpf == pytest.approx(measured_tpf(records)) == pytest.approx(1 + sum(lengths) / len(lengths))
    assert trace.acceptance().alphas[0] == pytest.approx(6 / 8)  # the two empty rounds stopped at depth 1


def test_rounds_to_a_token_budget_count_the_cut_last_round():
    from engine.analysis.acceptance import DepthAcceptance

    a = DepthAcceptance(reached=[10], accepted=[5])  # a round yields 1 or 2 tokens, each with chance 1/2
    assert a.tokens_distribution(1) == pytest.approx([0.5, 0.5])
    assert a.expected_rounds(30, 1, cut=False) == pytest.approx(20.0)
    assert a.expected_rounds(30, 1) == pytest.approx(20.0 + 2.5 / (2 * 1.5 ** 2))


def test_live_counts_from_running_metrics_match_the_trace():
    from engine.analysis.acceptance import DepthAcceptance
    from engine.core.metrics import MetricsAccumulator

    records = bursty_chain(rounds=20, k=4, every=3)
    acc = MetricsAccumulator(4)
    for r in records:
        metrics = acc.add_round(4, r["accepted_count"], len(r["emitted_ids"]), 4, 1.0, 1.0, 0.1)
    live = DepthAcceptance.from_metrics(metrics)
    traced = trace_from_events(records).acceptance()
    assert live.reached == traced.reached and live.accepted == traced.accepted


def test_small_bins_merge_into_their_neighbours():
    from engine.analysis.acceptance import _merge_small

    assert _merge_small([1, 9, 30, 2, 1], [2, 8, 30, 3, 1], 5) == ([10, 33], [10, 34])
    assert _merge_small([3, 1], [2, 2], 5) == ([4], [4])
    observed, expected = _merge_small([5, 0, 5, 0, 5], [5, 1, 5, 1, 5], 5)
    assert sum(observed) == 15 and sum(expected) == 17 and min(expected) >= 5


def test_plain_rounds_timed_beside_the_run_give_tpot_plain(tmp_path):
    """Plain rounds timed in the same stretch as the traced run set TPOT_plain; the curve and the draft terms
    stay those the trace refits."""
    from engine.analysis.costmodel import RoundTiming

    trace = load_trace(write_trace(tmp_path / "t.jsonl", bursty_chain(rounds=6)))
    costs = CostModel(verify={1: Measured(2.0), 5: Measured(3.0)}, plain=Measured(4.0))
    alone = predict_from_trace(trace, [1, 2], costs)
    plain = [RoundTiming("none", 1, 1, 0, 0.0, 0.5, 0.5) for _ in range(4)]  # 1 ms a plain round
    beside = predict_from_trace(trace, [1, 2], costs, plain)
    assert beside.costs.t_plain == pytest.approx(1.0) and alone.costs.t_plain > 1.5  # calibrated, rescaled
    assert beside.costs.t_verify(5) == alone.costs.t_verify(5)
    for a, b in zip(alone.predictions, beside.predictions):
        assert b.speedup == pytest.approx(a.speedup / alone.costs.t_plain)
        assert b.tokens_per_forward == a.tokens_per_forward
