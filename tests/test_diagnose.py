"""Each diagnosis rule fires on a trace built to trigger it, and a healthy trace gets none."""
import pytest
from trace_fixtures import chain_round, write_trace

from engine.analysis.costmodel import CostModel, Measured
from engine.analysis.diagnose import diagnose, format_diagnosis
from engine.analysis.predict import load_trace, trace_from_events


def costs(verify9=2.2) -> CostModel:
    """A plain round of 2.0 ms; verifying 9 tokens costs verify9."""
    return CostModel(verify={1: Measured(2.0), 3: Measured(2.05), 5: Measured(2.1), 9: Measured(verify9)},
                     overhead={"none": Measured(0.1)})


def healthy(i, k=4, **kw):
    return chain_round(i, k, k, draft_ms=0.1 * k, verify_ms=2.1, overhead_ms=0.1, **kw)


def rules(records, ks=range(1, 5), **kw):
    return diagnose(trace_from_events(records), costs(), ks, **kw).rules()


def test_a_healthy_run_has_no_findings():
    assert rules([healthy(i) for i in range(20)]) == []


def test_low_alpha():
    records = [chain_round(i, 4, 1 if i % 4 == 0 else 0, draft_ms=0.4, verify_ms=2.1, overhead_ms=0.1)
               for i in range(20)]
    assert "low_alpha" in rules(records)


def test_lookup_misses_are_not_low_acceptance():
    # n-gram found no match in half its rounds, and was right where it found one: no "misaligned draft"
    records = [chain_round(i, 4, 4 if i % 2 else 0, method="ngram", draft_ms=0.01, verify_ms=2.1,
                           overhead_ms=0.1, drafted_ids=[100, 101, 102, 103] if i % 2 else [])
               for i in range(20)]
    found = diagnose(trace_from_events(records), costs(), range(1, 5))
    assert "low_alpha" not in found.rules()
    assert found.report.acceptance.alphas[0] == pytest.approx(0.5)  # the predictions count the misses


@pytest.mark.parametrize("method, header, advice", [
    ("ngram", {}, "corpus table"),
    ("ngram", {"settings": {"ngram_corpus": True}}, "suffix decoding"),
    ("suffix", {}, "--suffix-corpus"),
])
def test_a_lookup_drafter_that_often_proposed_nothing(tmp_path, method, header, advice):
    records = [chain_round(i, 4, 2 if i % 3 == 0 else 0, method=method, draft_ms=0.01, verify_ms=2.1,
                           overhead_ms=0.1, drafted_ids=[100, 101, 102] if i % 3 == 0 else [])
               for i in range(30)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", records, header=header))
    found = diagnose(trace, costs(), range(1, 5))
    finding = next(f for f in found.findings if f.rule == "lookup_misses")
    assert "67 %" in finding.title and advice in finding.advice and finding.figure.endswith("20 of 30")
    assert "lookup_misses" not in rules([chain_round(i, 4, 2, method=method) for i in range(20)])
    assert "lookup_misses" not in rules([dict(r, method="draft") for r in records])  # not a lookup drafter


def test_c_too_high():
    records = [chain_round(i, 4, 4, draft_ms=4 * 1.2, verify_ms=2.1, overhead_ms=0.1) for i in range(20)]
    found = diagnose(trace_from_events(records), costs(), range(1, 5))
    assert "c_too_high" in found.rules()
    figure = next(f.figure for f in found.findings if f.rule == "c_too_high")
    assert "c = t_draft step / t_verify(1)" in figure


def test_overhead_dominated():
    records = [chain_round(i, 4, 4, draft_ms=0.4, verify_ms=2.1, overhead_ms=3.0) for i in range(20)]
    assert "overhead" in rules(records)


def test_k_past_optimum():
    # K = 8 but the draft never gets past depth 2: drafting 6 more tokens a round is wasted
    records = [chain_round(i, 8, 2, draft_ms=8 * 0.3, verify_ms=2.2, overhead_ms=0.1) for i in range(20)]
    found = diagnose(trace_from_events(records), costs(), range(1, 9))
    assert "k_past_optimum" in found.rules()
    assert found.report.best.k < 8


def test_a_best_k_past_the_runs_own_k_is_called_extrapolated():
    # every round accepts all K = 2: the model extends that past K, which this run never drafted
    records = [chain_round(i, 2, 2, draft_ms=0.02, verify_ms=2.05, overhead_ms=0.1) for i in range(20)]
    found = diagnose(trace_from_events(records), costs(), range(1, 9))
    advice = next(f.advice for f in found.findings if f.rule == "k_past_optimum")
    assert found.report.best.k > 2 and "extrapolated past this run's K = 2" in advice


def test_large_batch(tmp_path):
    records = [healthy(i) for i in range(20)]
    path = write_trace(tmp_path / "b.jsonl", records, header={"batch": 16})
    assert "large_batch" in diagnose(load_trace(path), costs(), range(1, 5)).rules()
    steep = diagnose(trace_from_events(records), CostModel(verify={1: Measured(1.0), 5: Measured(3.0)},
                                                           overhead={"none": Measured(0.1)}), range(1, 5))
    assert "large_batch" in steep.rules()


def test_output_changed():
    records = [healthy(i) for i in range(10)]
    records[3]["drafted"][0]["p"] = 0.2  # accepted in a greedy run, though the target's top choice had 0.9
    assert "output_changed" in rules(records)
    clean = [healthy(i) for i in range(3)]
    output = [t for r in clean for t in r["emitted_ids"]]
    assert "output_changed" not in rules(clean, reference_output=output)
    assert "output_changed" in rules(clean, reference_output=output[:2] + [7] + output[3:])


def test_slower_than_plain_and_the_report():
    records = [chain_round(i, 4, 0, draft_ms=4 * 1.2, verify_ms=2.1, overhead_ms=0.1) for i in range(20)]
    found = diagnose(trace_from_events(records), costs(), range(1, 5))
    assert found.rules()[0] == "slower"
    text = format_diagnosis(found)
    assert "plain round" in text and "figure:" in text
    plain, run = found.bars
    assert plain.total_ms == pytest.approx(2.1) and run.draft_ms == pytest.approx(4.8)
