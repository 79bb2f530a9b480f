"""Streamed, crash-safe exports (engine/files/exports.py) and the CLI's --csv/--trace through them."""
from __future__ import annotations

import csv
import errno
import json

import pytest

from engine.cli.main import main
from engine.core.metrics import csv_header
from engine.errors import SpecplayError
from engine.files.exports import ExportFormat, StreamingExport, csv_format, export_events, jsonl_format

PROMPT = "the cat sat on the mat. the cat"
FINISH = csv_header().index("finish_reason")


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs):
    """The session's tiny pair (conftest.py), as the command line names it."""
    return str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1])


@pytest.fixture(scope="module")
def events(pair):
    """Twelve real rounds of the tiny pair (greedy, one token a round with method none)."""
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    decoder = SpeculativeDecoder(load_pair(pair[0], pair[1], device="cpu"))
    return list(decoder.generate(PROMPT, GenerationConfig(method="none", max_new_tokens=12)))


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".part", ".lock")))


def read_csv(path):
    rows = list(csv.reader(path.open()))
    assert rows[0] == csv_header()
    return rows[1:]


def test_rows_stream_into_a_temp_file_and_land_whole(tmp_path, events):
    target = tmp_path / "m.csv"
    target.write_text("stale\n" * 50)
    with StreamingExport(target, csv_format()) as export:
        for event in events[:5]:
            export.add(event)
        (temp,) = tmp_path.glob(".m.csv.*.part")
        assert len(list(csv.reader(temp.open()))) == 1 + 4  # the header and all but the held-back row
        assert target.read_text() == "stale\n" * 50  # readers see the old file until the end
    rows = read_csv(target)
    assert [int(r[1]) for r in rows] == [1, 2, 3, 4, 5]  # CSV rounds count from 1
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("exc, reason", [(KeyboardInterrupt, "stopped"), (RuntimeError, "error")])
def test_an_interrupted_export_keeps_its_rounds_and_says_why(tmp_path, events, exc, reason):
    target = tmp_path / "t.jsonl"
    with pytest.raises(exc):
        with StreamingExport(target, jsonl_format()) as export:
            for event in events[:3]:
                export.add(event, generation=2)
            raise exc()
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1, 2] and records[0]["generation"] == 2
    assert [r["finish_reason"] for r in records] == [None, None, reason]
    assert leftovers(tmp_path) == []


def test_a_run_that_fails_before_its_first_round_leaves_the_old_file(tmp_path):
    target = tmp_path / "m.csv"
    target.write_text("earlier run\n")
    with pytest.raises(SpecplayError):
        with StreamingExport(target, csv_format()):
            raise SpecplayError("bad model")
    assert target.read_text() == "earlier run\n" and leftovers(tmp_path) == []


def test_a_full_disk_mid_export_is_one_clear_error_and_drops_the_temp_file(tmp_path, events):
    written = []

    def row(handle, event, generation, run_header):
        if len(written) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(event)
        handle.write("row\n")

    target = tmp_path / "m.csv"
    target.write_text("earlier run\n")
    with pytest.raises(SpecplayError, match="No space left on device"):
        with StreamingExport(target, ExportFormat(begin=lambda h: h.write("header\n"),
                                                  header=lambda h, r: None, row=row)) as export:
            for event in events:
                export.add(event)
    assert target.read_text() == "earlier run\n" and leftovers(tmp_path) == []


def test_a_second_writer_of_one_path_is_refused(tmp_path, events):
    target = tmp_path / "m.csv"
    with StreamingExport(target, csv_format()) as first:
        with pytest.raises(SpecplayError, match="another run is writing it"):
            StreamingExport(target, csv_format()).open()
        first.add(events[0])
    assert len(read_csv(target)) == 1
    assert export_events(target, "csv", events[:2]) == 2  # free again once the first has finished
    assert leftovers(tmp_path) == []


def test_a_special_file_is_written_in_place(events):
    assert export_events("/dev/null", "csv", events) == len(events)
    with pytest.raises(SpecplayError, match="No space left on device"):
        export_events("/dev/full", "csv", events)


def test_export_events_marks_the_last_round_of_a_stopped_generation(tmp_path, events):
    target = tmp_path / "m.csv"
    assert export_events(target, "csv", [(1, e) for e in events[:4]], finish="stopped") == 4
    assert [r[FINISH] for r in read_csv(target)] == ["", "", "", "stopped"]
    finished = events[-1].finish_reason
    export_events(target, "csv", events, finish="stopped")  # a round that finished itself keeps its reason
    assert read_csv(target)[-1][FINISH] == finished == "length"


def test_the_finished_file_has_the_usual_permissions(tmp_path, events):
    import os
    import stat

    target = tmp_path / "m.csv"
    export_events(target, "csv", events[:1])
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


# ------------------------------------------------------------------------------------------------ the CLI
def interrupt_after(monkeypatch, rounds: int, exc: BaseException):
    """Make SpeculativeDecoder.generate raise `exc` once it has yielded `rounds` rounds."""
    from engine.core.decoder import SpeculativeDecoder

    real = SpeculativeDecoder.generate

    def generate(self, prompt, config, should_stop=None):
        for i, event in enumerate(real(self, prompt, config, should_stop)):
            if i == rounds:
                raise exc
            yield event

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)


@pytest.mark.parametrize("exc, code, reason", [
    (RuntimeError("kernel exploded"), 1, "error"),
    (SpecplayError("the target model produced NaN logits"), 2, "error"),
    (KeyboardInterrupt(), 130, "stopped"),
])
def test_an_interrupted_run_keeps_a_valid_csv_and_trace_of_its_rounds(pair, tmp_path, capsys, monkeypatch,
                                                                      exc, code, reason):
    csv_path, trace_path = tmp_path / "m.csv", tmp_path / "t.jsonl"
    csv_path.write_text("an earlier run\n" * 100)
    interrupt_after(monkeypatch, 5, exc)
    got = main(["run", "--prompt", PROMPT, "--target", pair[0], "--draft", pair[1], "--k", "3",
                "--max-new-tokens", "60", "--csv", str(csv_path), "--trace", str(trace_path)])
    err = capsys.readouterr().err
    assert got == code and len(err.strip().splitlines()) == 1, err
    rows = read_csv(csv_path)
    assert [int(r[1]) for r in rows] == [1, 2, 3, 4, 5]  # CSV rounds count from 1
    assert [r[FINISH] for r in rows] == [""] * 4 + [reason]
    records = [json.loads(line) for line in trace_path.read_text().splitlines()]
    assert records[0]["type"] == "header" and records[0]["prompt"] == PROMPT
    trace = records[1:]
    assert [t["round"] for t in trace] == [0, 1, 2, 3, 4] and trace[-1]["finish_reason"] == reason
    assert leftovers(tmp_path) == []
    if code == 130:
        assert "interrupted after 5 rounds" in err and "m.csv" in err


def test_a_finished_run_replaces_an_earlier_runs_file(pair, tmp_path, capsys):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("an earlier run\n" * 100)
    code = main(["run", "--prompt", PROMPT, "--target", pair[0], "--method", "none", "--max-new-tokens", "6",
                 "--csv", str(csv_path)])
    assert code == 0, capsys.readouterr().err
    rows = read_csv(csv_path)
    assert len(rows) == 6 and rows[-1][FINISH] == "length"
    assert leftovers(tmp_path) == []


def test_a_run_whose_models_fail_to_load_leaves_the_earlier_file(tmp_path, capsys):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("an earlier run\n")
    code = main(["run", "--prompt", "x", "--target", str(tmp_path / "missing"), "--csv", str(csv_path)])
    assert code == 2 and "missing" in capsys.readouterr().err
    assert csv_path.read_text() == "an earlier run\n" and leftovers(tmp_path) == []


def test_sigterm_stops_a_run_and_keeps_its_rounds(pair, tmp_path, capsys, monkeypatch):
    import os
    import signal

    from engine.core.decoder import SpeculativeDecoder

    real = SpeculativeDecoder.generate

    def generate(self, prompt, config, should_stop=None):
        for i, event in enumerate(real(self, prompt, config, should_stop)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            yield event

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    csv_path = tmp_path / "m.csv"
    code = main(["run", "--prompt", PROMPT, "--target", pair[0], "--method", "none", "--max-new-tokens", "30",
                 "--csv", str(csv_path)])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    rows = read_csv(csv_path)
    assert 3 <= len(rows) < 30 and rows[-1][FINISH] == "stopped"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the run


def test_a_killed_writers_temp_file_is_removed_by_the_next_writer(tmp_path, events):
    target = tmp_path / "m.csv"
    orphan = tmp_path / ".m.csv.abc_1234.part"
    orphan.write_text("half a run\n")
    others = [tmp_path / ".other.csv.abc_1234.part", tmp_path / ".m.csv.x.abc_1234.part"]
    for other in others:
        other.write_text("another target's\n")
    export_events(target, "csv", events[:2])
    assert not orphan.exists() and all(o.exists() for o in others) and len(read_csv(target)) == 2


def test_a_header_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    def begin(handle):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "m.csv"
    with pytest.raises(SpecplayError, match="No space left"):
        StreamingExport(target, ExportFormat(begin=begin, header=lambda h, r: None,
                                             row=lambda h, e, g, r: None)).open()
    assert list(tmp_path.iterdir()) == []
    export_events(target, "csv", [])  # and the path is free
    assert target.read_text().startswith("generation")


def test_a_sweep_table_is_written_whole_with_every_key_as_a_column(tmp_path):
    """export_table: one column per key in first-seen order, missing and None values empty, the old file
    replaced whole; a folder that does not exist is one clear error."""
    from engine.files.exports import export_table

    path = tmp_path / "sweep.csv"
    path.write_text("an older table\n")
    rows = [{"method": "none", "alpha": None, "speedup": 1.0},
            {"method": "ngram", "alpha": 0.6, "speedup": 1.82, "textbook_speedup": 2.1}]
    assert export_table(path, rows) == 2
    assert list(csv.reader(path.open())) == [["method", "alpha", "speedup", "textbook_speedup"],
                                             ["none", "", "1.0", ""], ["ngram", "0.6", "1.82", "2.1"]]
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.csv"]  # no temporary or lock file left
    with pytest.raises(SpecplayError, match="does not exist"):
        export_table(tmp_path / "missing" / "t.csv", rows)
