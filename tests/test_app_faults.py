"""The window's session survives faults: a failing generation, a corrupt settings file, interrupted runs in
the exports."""
from __future__ import annotations

import csv

import pytest
from app_windows import answer_save
from test_app import FakeDecoder, generate, make_window  # noqa: F401 - make_window is a fixture

from app.settings import DEFAULTS, AppSettings
from engine.core.metrics import csv_header

pytestmark = pytest.mark.usefixtures("isolated_qsettings")
FINISH = csv_header().index("finish_reason")


def settings_file(isolated_qsettings):
    folder = isolated_qsettings / "specplay"
    folder.mkdir(exist_ok=True)
    return folder / "specplay.ini"


def test_a_failing_generation_keeps_the_earlier_runs_and_settings(qtbot, make_window, tmp_path):  # noqa: F811
    window = make_window(FakeDecoder(rounds=5))
    window.method_actions["ngram"].trigger()
    window.k_actions[6].trigger()
    generate(qtbot, window)
    first = window.session.generations[0]
    window.fake.fail_at = 2
    generate(qtbot, window)
    assert window.errors == [("Generation failed", "The engine failed: RuntimeError: kernel exploded")]
    assert [g.finish for g in window.session.generations] == ["length", "error"]
    assert len(first.events) == 5 and len(window.session.generations[1].events) == 2
    assert window.history.count() == 2
    config = AppSettings().config()
    assert (config.method, config.k) == ("ngram", 6)
    assert window.k_actions[6].isChecked() and window.method_actions["ngram"].isChecked()
    path = tmp_path / "session.csv"
    answer_save(window, path)
    window.export_csv()
    rows = list(csv.reader(path.open()))[1:]
    assert [r[0] for r in rows] == ["1"] * 5 + ["2"] * 2
    assert [r[FINISH] for r in rows] == ["", "", "", "", "length", "", "error"]
    window.fake.fail_at = None
    generate(qtbot, window)  # and the session carries on
    assert [g.finish for g in window.session.generations] == ["length", "error", "length"]


def test_a_stopped_generation_is_exported_as_stopped(qtbot, make_window, tmp_path):  # noqa: F811
    window = make_window(FakeDecoder(rounds=500, delay=0.01))
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 3, timeout=5000)
    window.stop()
    qtbot.waitUntil(lambda: not window.running, timeout=2000)
    path = tmp_path / "trace.jsonl"
    answer_save(window, path)
    window.export_jsonl()
    header, *lines = path.read_text().splitlines()
    assert '"type": "header"' in header  # the trace starts with the generation's settings
    assert len(lines) == len(window.session.generations[0].events) >= 3
    assert '"finish_reason": "stopped"' in lines[-1] and '"finish_reason": null' in lines[0]
    assert window.session.generations[0].events[-1].finish_reason is None  # the session itself is unchanged


CORRUPT = {
    "wrong types and ranges": (
        "[decode]\nk=banana\nmax_new_tokens=99999999999999999999999\ntemperature=nan\ntop_p=7\nseed=-5\n"
        "greedy=maybe\ntop_k=1e9\n[view]\ntheme=purple\nplots=3\n[window]\ngeometry=hello\n"
    ).encode(),
    "random bytes": bytes((i * 7919 + 13) % 256 for i in range(3000)),
    "binary with NUL": b"\x00\x00[decode]\x00k=\x00\xff\xfe\n=\n[[[\n",
}


@pytest.mark.parametrize("content", list(CORRUPT.values()), ids=list(CORRUPT))
def test_a_corrupt_settings_file_is_reset_with_a_message(qtbot, make_window, isolated_qsettings,  # noqa: F811
                                                         content):
    settings_file(isolated_qsettings).write_bytes(content)
    window = make_window()
    assert len(window.errors) == 1 and window.errors[0][0] == "Settings reset", window.errors
    assert "specplay.ini" in window.errors[0][1]
    settings = AppSettings()
    assert settings.notice is None  # repaired once: read again, the file is clean
    for key, default in DEFAULTS.items():
        assert settings.get(key) == default, key
    assert window.max_tokens.value() == DEFAULTS["decode/max_new_tokens"]
    generate(qtbot, window)
    assert window.session.generations[0].finish == "length"


def test_a_wrong_value_names_its_key_and_the_others_are_kept(isolated_qsettings):
    settings_file(isolated_qsettings).write_text("[decode]\nk=7\nmethod=ngram\ntop_p=nan\n")
    settings = AppSettings()
    assert "decode/top_p" in settings.notice and "decode/k" not in settings.notice
    assert settings.config().k == 7 and settings.config().method == "ngram"
    assert settings.get("decode/top_p") == DEFAULTS["decode/top_p"]


# ------------------------------------------------------------------------------------------ the kept session
def _statuses(window) -> list:
    shown = []
    original = window.show_status

    def record(message, timeout_ms=0):
        shown.append(message)
        original(message, timeout_ms)

    window.show_status = record
    return shown


def test_the_session_survives_closing_the_window(qtbot, make_window):  # noqa: F811
    window = make_window(FakeDecoder(rounds=4))
    generate(qtbot, window, "def first():")
    window.method_actions["ngram"].trigger()
    generate(qtbot, window, "def second():")
    before = [(g.prompt, g.config, [e.emitted_ids for e in g.events], g.finish)
              for g in window.session.generations]
    path = window.settings.session_path()
    assert path.exists()  # kept after each generation, not only on close
    window.close()

    again = make_window(start=False)
    shown = _statuses(again)
    again.start()
    qtbot.waitUntil(lambda: again.load_job is None, timeout=5000)
    after = [(g.prompt, g.config, [e.emitted_ids for e in g.events], g.finish)
             for g in again.session.generations]
    assert after == before
    assert again.history.count() == 2 and "replayed" in again.history.item(1).text()
    assert any("Restored 2 generations" in m for m in shown)
    generate(qtbot, again, "def third():")  # new runs follow the restored ones
    assert [g.index for g in again.session.generations] == [1, 2, 3]


def test_closing_mid_run_keeps_the_rounds_so_far(qtbot, make_window):  # noqa: F811
    window = make_window(FakeDecoder(rounds=10000, delay=0.005))
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 3, timeout=5000)
    job = window.gen_job
    window.close()
    kept = len(window.session.generations[0].events)
    assert job.worker.mailbox.empty()  # the rounds posted before the close were taken, not dropped
    assert [e.round for e in window.session.generations[0].events] == list(range(kept))

    again = make_window()
    restored = again.session.generations
    assert len(restored) == 1 and restored[0].finish == "stopped"
    assert len(restored[0].events) == kept >= 3


def test_clearing_the_session_forgets_the_kept_one(qtbot, make_window):  # noqa: F811
    window = make_window(FakeDecoder(rounds=3))
    generate(qtbot, window)
    path = window.settings.session_path()
    assert path.exists()
    window.clear_session()
    assert not path.exists()
    window.close()
    assert not path.exists()  # an empty session leaves no file
    assert make_window().session.generations == []


def test_an_unreadable_kept_generation_is_moved_aside(qtbot, make_window):  # noqa: F811
    window = make_window(FakeDecoder(rounds=3))
    generate(qtbot, window, "def first():")
    generate(qtbot, window, "def second():")
    folder = window.settings.session_path()
    window.close()
    first, second = sorted(folder.glob("*.jsonl"))
    first.write_text("this is not a trace\n")

    again = make_window(start=False)
    shown = _statuses(again)
    again.start()
    qtbot.waitUntil(lambda: again.load_job is None, timeout=5000)
    assert [g.prompt for g in again.session.generations] == ["def second():"] and again.errors == []
    aside = first.with_name(first.name + ".unreadable")
    assert not first.exists() and aside.read_text() == "this is not a trace\n"
    assert any("could not be read" in m and aside.name in m for m in shown)


def test_keeping_a_generation_writes_only_that_generation(qtbot, make_window):  # noqa: F811
    """One file per generation: a long session's next generation does not rewrite the earlier ones."""
    window = make_window(FakeDecoder(rounds=3))
    generate(qtbot, window, "def first():")
    folder = window.settings.session_path()
    (kept,) = folder.glob("*.jsonl")
    before = kept.stat().st_mtime_ns, kept.read_bytes()
    for prompt in ("def second():", "def third():"):
        generate(qtbot, window, prompt)
    files = sorted(folder.glob("*.jsonl"))
    assert [f.name for f in files] == ["000001.jsonl", "000002.jsonl", "000003.jsonl"]
    assert (files[0].stat().st_mtime_ns, files[0].read_bytes()) == before
    window.close()
    assert len(list(folder.glob("*.jsonl"))) == 3  # nothing new to keep on close
    again = make_window()
    generate(qtbot, again, "def fourth():")
    assert [f.name for f in sorted(folder.glob("*.jsonl"))][-1] == "000004.jsonl"
    assert [g.prompt for g in again.session.generations] == ["def first():", "def second():", "def third():",
                                                             "def fourth():"]
