"""The trace format (engine.files.trace): a header per generation, then its rounds; read back into
RoundEvents."""
import json

import pytest

from engine.config import GenerationConfig, SamplingParams
from engine.core.metrics import MetricsAccumulator, csv_rows, write_csv, write_jsonl
from engine.errors import SpecplayError
from engine.events import DraftedToken, RoundEvent
from engine.files.trace import FORMAT, Run, make_header, read_trace, trace_records


def event(index: int, last: bool = False, finish=None) -> RoundEvent:
    metrics = MetricsAccumulator(2).add_round(2, 1, 2, 2, 1.0, 2.0, 0.5)
    drafted = [DraftedToken(1, "a", -1, 0, 0.6, 0.5, 1.0, 0.2, True, True, [("a", 0.6), ("b", 0.3)]),
               DraftedToken(2, "\n", 0, 1, 0.1, 0.7, 0.14, 0.9, False, True, [])]
    return RoundEvent(round=index, method="draft", k=2, drafted=drafted, accepted_count=1, next_token_id=5,
                      next_token_text="c", next_is_bonus=False, next_token_p=0.4, next_top=[("c", 0.4)],
                      emitted_ids=[1, 5], emitted_text="ac", position=2 * index, draft_ms=1.0, verify_ms=2.0,
                      overhead_ms=0.5, finished=last, finish_reason=finish, metrics=metrics)


CONFIG = GenerationConfig(method="eagle", k=2, sampling=SamplingParams(0.7, 40, 0.9), seed=9, tree_nodes=8)


def runs():
    first = Run(make_header("p ü", CONFIG, "t", "d", "CPU", "float32", 1), [event(0), event(1)], "stopped")
    plain = GenerationConfig(method="none")
    header = make_header("q", plain, "t", None, "CPU", "float32", 2)
    second = Run(header, [event(0, True, "length")], "length")
    return [first, second]


def test_a_trace_is_headers_then_rounds_and_reads_back(tmp_path):
    path = tmp_path / "t.jsonl"
    assert write_jsonl(trace_records(runs()), path) == 3
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r["type"] for r in records] == ["header", "round", "round", "header", "round"]
    head = records[0]
    assert head["format"] == FORMAT and head["prompt"] == "p ü" and head["spec"] == "eagle:8"
    assert head["settings"] == CONFIG.to_dict() and head["models"] == {"target": "t", "draft": "d"}
    assert (head["device"], head["dtype"]) == ("CPU", "float32") and "torch" in head["versions"]
    assert records[2]["finish_reason"] == "stopped"  # the end of a stopped run is recorded
    back = read_trace(path)
    assert [r.generation for r in back] == [1, 2] and back[0].finish == "stopped"
    assert back[0].config == CONFIG and back[1].config.method == "none"
    assert back[0].events[0] == event(0)  # every field, tuples of alternatives included
    assert back[1].events[0] == event(0, True, "length")


def test_csv_rows_carry_the_settings_and_every_end(tmp_path):
    path = tmp_path / "m.csv"
    assert write_csv(csv_rows(runs()), path) == 3
    import csv

    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert rows[0]["method"] == "eagle:8" and rows[0]["k [tokens]"] == "2" and rows[0]["top_k"] == "40"
    assert rows[0]["tree_nodes [nodes]"] == "8" and rows[0]["seed"] == "9" and rows[0]["draft"] == "d"
    assert [r["finish_reason"] for r in rows] == ["", "stopped", "length"]
    assert rows[2]["method"] == "none" and rows[2]["k [tokens]"] == "" and rows[2]["draft"] == ""
    assert [r["round"] for r in rows] == ["1", "2", "1"]


def test_an_old_headerless_trace_still_reads(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(json.dumps({"generation": 1, **event(i).to_dict()}) for i in range(3)) + "\n")
    (run,) = read_trace(path)
    assert len(run.events) == 3 and run.prompt == "" and run.config.method == "draft" and run.config.k == 2


@pytest.mark.parametrize("text, needle", [("", "no rounds"), ("[1]\n", "not a trace record"),
                                          ("{oops\n", "not JSON"),
                                          ('{"type": "round"}\n', "field method: missing")])
def test_a_file_that_is_not_a_trace_is_one_clear_error(tmp_path, text, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(SpecplayError, match=needle):
        read_trace(path)


def test_non_utf8_and_missing_files_are_clear_errors(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecplayError, match="not valid UTF-8"):
        read_trace(path)
    with pytest.raises(SpecplayError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_an_events_dict_is_what_dataclasses_asdict_gives_and_owns_its_lists(tmp_path):
    """RoundEvent.to_dict walks its fields by hand (asdict deep-copied every value at 0.2 ms a round); it must
    give the same dict, of live events and of events read back from a trace (lists for pairs there)."""
    from dataclasses import asdict

    path = tmp_path / "t.jsonl"
    write_jsonl(trace_records(runs()), path)
    read_back = [e for run in read_trace(path) for e in run.events]
    for original in [event(0), event(1, True, "length")] + read_back:
        as_dict = original.to_dict()
        assert as_dict == asdict(original)
        as_dict["drafted"][0]["top"].append(("z", 0.0))
        as_dict["metrics"]["per_position_acceptance"].append(9.0)
        as_dict["next_top"].clear()
        assert original.to_dict() == asdict(original) != as_dict  # the event itself did not change
