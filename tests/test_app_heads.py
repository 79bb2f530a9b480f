"""Models → Open draft heads… and Models → Head doctor… (issue 51): published heads loaded onto the loaded
tiny target off the GUI thread, described in a dialog, their methods offered by the Method menu; a misfit is
one dialog of one line; the doctor's report as a table of conventions with intervals and findings."""
from __future__ import annotations

import json

import pytest
from app_windows import open_real_window
from test_public_heads import make_eagle3, make_medusa, target_dir  # noqa: F401 (a fixture)

from app import heads
from app.main_window import MainWindow

pytestmark = pytest.mark.usefixtures("isolated_qsettings")


@pytest.fixture
def window(qtbot, target_dir):  # noqa: F811
    window = open_real_window(qtbot, target_dir)  # the target alone: no draft, no heads of its own
    window.infos = []
    window.show_info = lambda title, message: window.infos.append((title, message))
    return window


def open_heads(qtbot, window, folder) -> None:
    window.open_draft_heads(str(folder))
    assert window.load_job is not None  # off the GUI thread
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)


def test_published_eagle3_heads_are_described_and_offered(qtbot, window, tmp_path):
    assert not window.method_actions["eagle3"].isEnabled()
    open_heads(qtbot, window, make_eagle3(tmp_path / "heads", "speculators", taps=(1, 2, 3), draft_vocab=24))
    assert window.errors == []
    [(title, text)] = window.infos
    assert title == "Draft heads loaded"
    assert "layout: EAGLE-3 (speculators)" in text and "trained for: tiny/target" in text
    assert "tapped layers: [1, 2, 3]" in text and "draft vocabulary: 24 tokens" in text
    assert "EAGLE-3" in text.split("the Method menu offers:")[1]
    assert window.availability["eagle3"] is None and window.method_actions["eagle3"].isEnabled()
    assert window.decoder.heads_info.method == "eagle3"


def test_medusa_heads_offer_both_medusa_entries(qtbot, window, tmp_path):
    open_heads(qtbot, window, make_medusa(tmp_path / "medusa"))
    assert window.errors == [] and "Medusa-1 (FasterDecoding)" in window.infos[0][1]
    assert window.method_actions["medusa"].isEnabled()


def test_heads_that_do_not_fit_are_one_dialog_of_one_line(qtbot, window, tmp_path):
    folder = make_eagle3(tmp_path / "bad", "specforge")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 48  # not the target's
    (folder / "config.json").write_text(json.dumps(config))
    open_heads(qtbot, window, folder)
    assert window.infos == []
    [(title, message)] = window.errors
    assert title == "Cannot use these heads" and "\n" not in message and "Traceback" not in message
    assert not window.method_actions["eagle3"].isEnabled()


def test_a_folder_of_no_known_layout_and_an_empty_source_are_dialogs(qtbot, window, tmp_path):
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "config.json").write_text("{}")
    open_heads(qtbot, window, tmp_path / "nothing")
    window.open_draft_heads("  ".strip())
    assert [t for t, _ in window.errors] == ["Cannot use these heads", "No heads given"]
    assert "no known head layout" in window.errors[0][1]


def test_the_head_doctor_shows_each_convention_with_intervals_and_findings(qtbot, window, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(heads, "DOCTOR_NEW_TOKENS", 8)
    window.prompt.setPlainText("the cat sat on the mat. the cat")
    open_heads(qtbot, window, make_eagle3(tmp_path / "heads", "speculators", taps=(1, 2, 3), draft_vocab=24))
    window.method_actions["eagle3"].trigger()
    window.k_actions[2].trigger()
    window.doctor_action.trigger()
    assert window.running and not window.doctor_action.isEnabled()
    qtbot.waitUntil(lambda: not window.running, timeout=120000)
    assert window.errors == [] and window.doctor_dialog is not None
    dialog = window.doctor_dialog
    report = dialog.report
    assert report.method == "eagle3" and report.k == 2 and len(report.results) >= 2  # taps and norm options
    assert dialog.table.rowCount() == len(report.results)
    headers = [dialog.table.horizontalHeaderItem(c).text() for c in range(dialog.table.columnCount())]
    assert headers[:3] == ["convention", "tokens / forward", "α1 [95% interval]"]
    assert "[config]" in dialog.table.item(0, 0).text()
    assert dialog.table.item(0, 1).text() == f"{report.results[0].tokens_per_forward:.2f}"
    assert "[" in dialog.table.item(0, 2).text() or dialog.table.item(0, 2).text() == "not reached"
    assert "finding:" in dialog.findings.text() and "draft vocabulary covers" in dialog.findings.text()
    assert window.doctor_action.isEnabled()


def test_a_doctor_that_fails_is_a_dialog(qtbot, window, tmp_path, monkeypatch):
    open_heads(qtbot, window, make_medusa(tmp_path / "medusa"))
    window.method_actions["medusa"].trigger()
    window.prompt.setPlainText("x " * 400)  # past the tiny target's context of 256 tokens
    window.head_doctor()
    qtbot.waitUntil(lambda: not window.running, timeout=60000)
    assert window.doctor_dialog is None
    [(title, message)] = window.errors
    assert title == "Head doctor failed" and "context" in message and "Traceback" not in message


def test_the_doctor_without_heads_is_a_dialog(qtbot, window):
    window.method_actions["none"].trigger()
    window.head_doctor()
    assert window.doctor_dialog is None and not window.running
    assert window.errors[0][0] == "No heads to diagnose" and "Open draft heads" in window.errors[0][1]


def test_doctor_method_follows_the_menu_then_the_opened_heads():
    class Info:
        method = "eagle3"

    assert heads.doctor_method("medusa-fixed", None) == "medusa"
    assert heads.doctor_method("eagle", Info()) == "eagle"
    assert heads.doctor_method("draft", Info()) == "eagle3"
    assert heads.doctor_method("ngram", None) is None


def test_no_heads_before_a_model_is_loaded(qtbot):
    window = MainWindow(loader=lambda *a: None, device="cpu")
    window.errors = []
    window.show_error = lambda title, message: window.errors.append((title, message))
    qtbot.addWidget(window)
    window.open_draft_heads("/nowhere")
    window.head_doctor()
    assert [t for t, _ in window.errors] == ["No model loaded", "No model loaded"]
    assert window.load_job is None
