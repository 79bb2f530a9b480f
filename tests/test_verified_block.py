"""Each round records the block its verification forward took (RoundEvent.verified_tokens), and the cost model
is refitted at that block: on the GPU n-gram's replayed round verifies all K slots (K + 1 rows) however few
tokens its lookup found, and binning those rounds by their drafts had made the verification curve flat at the
run's level, so that predictions from a K = 8 run gave every smaller K a K = 8 round."""
from dataclasses import replace

import pytest
from tiny_models import make_tiny_pair
from trace_fixtures import chain_round, write_trace

from engine.analysis.costmodel import CostModel, Measured, timing_of
from engine.analysis.predict import load_trace, predict_from_trace
from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.core.metrics import csv_header, csv_row
from engine.files.trace import event_from_dict
from engine.models.loading import load_pair

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"))
    return SpeculativeDecoder(load_pair(str(target), str(draft), device="cpu"))


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "suffix", "lookahead"])
def test_a_cpu_round_verifies_what_it_drafted(decoder, method):
    events = list(decoder.generate(PROMPT, GenerationConfig(method=method, k=4, max_new_tokens=24)))
    assert events and all(e.verified_tokens == len(e.drafted) + 1 for e in events)
    again = [event_from_dict(e.to_dict()) for e in events]  # a trace keeps the field
    assert [e.verified_tokens for e in again] == [e.verified_tokens for e in events]


def test_timing_of_reads_the_verified_block_and_falls_back_for_older_traces(decoder):
    record = chain_round(0, 8, 1, method="ngram", drafted_ids=[100, 101])
    assert timing_of(record).block == 3  # no verified_tokens: drafted + 1, as traces before it
    assert timing_of(dict(record, verified_tokens=9)).block == 9
    event = next(iter(decoder.generate(PROMPT, GenerationConfig(method="draft", k=2, max_new_tokens=4))))
    assert timing_of(event).block == 3
    assert timing_of(replace(event, verified_tokens=9)).block == 9
    assert timing_of(replace(event, verified_tokens=None)).block == 3
    column = csv_header().index("verified [tokens]")  # the CSV export says it too
    assert csv_row(event)[column] == 3 and csv_row(replace(event, verified_tokens=9))[column] == 9


def _gpu_ngram_trace(tmp_path, verified: bool):
    """A K = 8 n-gram run on a GPU: rounds whose lookups found 0..8 tokens, every one verifying 9 rows in
    4.4 ms (twice the calibrated 2.2: the machine as loaded during the run)."""
    records = []
    for i in range(36):
        found = i % 9
        record = chain_round(i, 8, min(found, 1), method="ngram", draft_ms=0.01, verify_ms=4.4,
                             overhead_ms=0.1, drafted_ids=[100 + d for d in range(found)])
        records.append(dict(record, verified_tokens=9) if verified else record)
    header = {"device": "NVIDIA H100 80GB HBM3", "settings": {"method": "ngram", "k": 8}}
    return load_trace(write_trace(tmp_path / f"gpu_{verified}.jsonl", records, header=header))


def test_the_refit_keeps_the_calibrated_shape_below_the_block_a_gpu_round_verified(tmp_path):
    calibrated = CostModel(verify={1: Measured(2.0), 3: Measured(2.05), 5: Measured(2.1), 9: Measured(2.2)},
                           overhead={"none": Measured(0.1)})
    trace = _gpu_ngram_trace(tmp_path, verified=True)
    refitted = calibrated.refit(trace.timings())
    assert refitted.t_verify(9) == pytest.approx(4.4)
    assert refitted.t_verify(3) == pytest.approx(4.1)  # 2.05 at the run's level (x 2), not the run's 4.4
    report = predict_from_trace(trace, [2, 8], calibrated)
    rounds = {p.k: p.round_ms for p in report.predictions}
    assert rounds[2] == pytest.approx(4.1 + 0.01 * 2 + 0.1, rel=0.05) and rounds[2] < rounds[8]
    # the same rounds binned by their drafts, as before: every block at the run's 4.4 ms
    flat = calibrated.refit(_gpu_ngram_trace(tmp_path, verified=False).timings())
    assert flat.t_verify(3) == pytest.approx(4.4)
