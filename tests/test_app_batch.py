"""K → Batch regime: the batched bench off the GUI thread, its dialog, Esc and failures (tiny real models)."""
from __future__ import annotations

import math
import threading

import pytest
from app_windows import open_real_window
from PySide6.QtCore import Qt

from app import backend
from app.batch_dialog import BatchDialog, loses_everywhere, suggestion
from app.dialogs import HELP_HTML
from app.main_window import MainWindow
from engine.bench import batch as batch_bench
from engine.bench import roofline
from engine.bench.batch import BatchReport, BatchRow

pytestmark = pytest.mark.usefixtures("isolated_qsettings")
backend.preload_engine()

PROMPT = "the cat sat on the mat. the cat"


@pytest.fixture
def window(qtbot, tiny_pair_dirs):
    """The window on the tiny real pair, method draft model, K = 2, batches 1, 2, 4 of 6 new tokens."""
    window = open_real_window(qtbot, *tiny_pair_dirs)
    window.method_actions["draft"].trigger()
    window.k_actions[2].trigger()
    window.prompt.setPlainText(PROMPT)
    window.batch_sizes = (1, 2, 4)
    window.batch_new_tokens = 6
    return window


def record_progress(window) -> list:
    calls = []
    real = window.set_progress

    def spy(done, total, text=""):
        calls.append((done, total, text))
        real(done, total, text)

    window.set_progress = spy
    return calls


def test_batch_regime_plots_the_rows_the_prediction_and_suggests(qtbot, window):
    progress = record_progress(window)
    window.batch_action.trigger()
    assert window.running and not window.batch_action.isEnabled() and not window.sweep_action.isEnabled()
    assert window.progress.isVisible()
    qtbot.waitUntil(lambda: window.batch_dialog is not None, timeout=60000)
    qtbot.waitUntil(lambda: not window.running, timeout=10000)
    assert window.errors == [] and window.batch_action.isEnabled()
    counted = [(d, t) for d, t, text in progress if text.startswith("Batch regime: %v of %m")]
    assert counted == [(1, 3), (2, 3), (3, 3)]  # B done of N
    dialog = window.batch_dialog
    assert dialog.complete and [r.batch for r in dialog.rows] == [1, 2, 4]
    assert dialog.table.rowCount() == 3 and dialog.table.item(2, 0).text() == "4"
    xs, ys = dialog.measured_curve.getData()
    assert list(xs) == [0.0, 1.0, 2.0] and list(ys) == pytest.approx([r.speedup for r in dialog.rows])
    px, py = dialog.predicted_curve.getData()
    assert len(px) >= 17 and px[0] == 0.0 and all(s > 0 for s in py)
    assert dialog.unity_line.value() == 1.0
    assert dialog.report.k == 2 and dialog.report.method == "draft"
    assert "speculation" in dialog.suggestion_text.lower() and dialog.suggestion_text in dialog.summary.text()
    if dialog.report.measured_crossover is None or loses_everywhere(dialog.rows):  # no crossover to mark
        assert dialog.crossover_line is None
    else:
        assert dialog.crossover_line.value() == pytest.approx(math.log2(dialog.report.measured_crossover))


def test_escape_stops_after_the_batch_it_measures_and_suggests_nothing(qtbot, window, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = batch_bench.measure_batch

    def gated(decoder, prompts, config, repeats=1):
        entered.set()
        release.wait(20)
        return real(decoder, prompts, config, repeats)

    monkeypatch.setattr(batch_bench, "measure_batch", gated)
    window.batch_action.trigger()
    qtbot.waitUntil(entered.is_set, timeout=10000)  # measuring B = 1
    window.view.setFocus()
    qtbot.keyClick(window.view, Qt.Key_Escape)
    release.set()
    qtbot.waitUntil(lambda: window.batch_dialog is not None, timeout=60000)
    qtbot.waitUntil(lambda: not window.running, timeout=10000)
    dialog = window.batch_dialog
    assert [r.batch for r in window.batch_rows] == [1] and [r.batch for r in dialog.rows] == [1]
    assert not dialog.complete and dialog.suggestion_text == "" and dialog.table.rowCount() == 1
    assert "suggests no operating point" in dialog.summary.text()
    assert "stopped" in dialog.windowTitle() and window.errors == []


def test_a_failure_becomes_a_dialog(qtbot, window, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("the roofline melted")

    monkeypatch.setattr(batch_bench, "bench_batch", explode)
    window.batch_action.trigger()
    qtbot.waitUntil(lambda: not window.running, timeout=10000)
    qtbot.waitUntil(lambda: window.errors != [], timeout=5000)
    assert window.errors == [("Batch regime failed", "The engine failed: RuntimeError: the roofline melted")]
    assert window.batch_dialog is None and window.batch_action.isEnabled()


def test_batch_regime_needs_a_batched_method(qtbot, window):
    window.method_actions["none"].trigger()
    window.batch_action.trigger()
    assert window.errors[-1][0] == "No drafting method" and not window.running
    if window.method_actions["lookahead"].isEnabled():
        window.method_actions["lookahead"].trigger()
        window.batch_action.trigger()
        assert window.errors[-1][0] == "No batched method" and not window.running


def test_the_shortcut_is_in_the_menu_and_in_help(qtbot, window):
    assert window.batch_action.shortcut().toString() == "Ctrl+B"
    assert "<b>Ctrl+B</b>" in HELP_HTML and "Batch regime" in HELP_HTML


# ------------------------------------------------------------------------------------- the dialog alone
def make_report(speedups, measured_crossover, predicted_crossover=None) -> BatchReport:
    batches = [2 ** i for i in range(len(speedups))]
    rows = [BatchRow(batch=b, plain_tokens_per_s=100.0 * b, spec_tokens_per_s=100.0 * b * s,
                     tokens_per_round=2.0, plain_tokens_per_round=1.0, acceptance_rate=0.6,
                     plain_round_ms=1.0, spec_round_ms=1.0, step_ms=1.0, verify_step_ms=1.0 + b,
                     predicted_speedup=s) for b, s in zip(batches, speedups, strict=True)]
    fit = roofline.Roofline(floor_ms=1.0, ms_per_token=0.1)
    return BatchReport(rows=rows, method="draft", k=3, ks=[1, 2, 3], device="CPU", max_new_tokens=8,
                       target_fit=fit, draft_fit=None, weight_bytes=1, flops_per_token=1.0, bandwidth=1.0,
                       matmul_flops=1.0, measured_crossover=measured_crossover,
                       predicted_crossover=predicted_crossover)


def test_the_dialog_marks_the_crossover_and_suggests_the_operating_point(qtbot):
    speedups = [1.8, 1.5, 1.1, 0.8, 0.6]
    crossover = roofline.crossover([1, 2, 4, 8, 16], speedups)
    dialog = BatchDialog(None, make_report(speedups, crossover, 6.0), "title")
    qtbot.addWidget(dialog)
    assert 4 < crossover < 8 and dialog.crossover_line.value() == pytest.approx(math.log2(crossover))
    text = dialog.suggestion_text
    assert f"below B ≈ {crossover:.0f}" in text and "off</b> above" in text
    assert dialog.table.rowCount() == 5
    assert dialog.predicted_crossover_line.value() == pytest.approx(math.log2(6.0))


def test_the_suggestion_without_a_crossover_and_when_speculation_always_loses(qtbot):
    on = make_report([1.6, 1.4, 1.2], None, 40.0)
    text = suggestion(on, True)
    assert "on</b> (K = 3) at every measured batch" in text and "B ≈ 40" in text
    dialog = BatchDialog(None, on, "title")
    qtbot.addWidget(dialog)
    assert dialog.crossover_line is None
    assert dialog.predicted_crossover_line is None  # 40 > 4 x 4: off the plot
    off = make_report([0.9, 0.8], 1.0)
    assert "off</b> at every batch" in suggestion(off, True)
    assert suggestion(make_report([1.5], None), True) == ""  # one batch: no curve
    assert suggestion(on, complete=False) == ""


def test_a_decoder_without_a_model_pair_is_refused_in_words():
    from app.workers import batch_decoder
    from engine.errors import SpecplayError

    with pytest.raises(SpecplayError, match="no model pair"):
        batch_decoder(object())


def test_batched_methods_include_eagles_chain():
    from app.batch_dialog import method_problem

    assert method_problem("eagle") is None and method_problem("draft") is None
    title, message = method_problem("eagle", 8)
    assert title == "No batched method" and "eagle:8" in message and "EAGLE's chain" in message
    assert method_problem("medusa")[0] == "No batched method"


def test_batch_regime_with_eagle(qtbot, tmp_path, tiny_pair_dirs):
    """EAGLE's chain in the batch regime (a one-layer target with a head that drafts well); its tree is
    refused with the reason."""
    from test_batch import add_copied_eagle_head
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", vocab=96, hidden=64, layers=1, seed=0)
    add_copied_eagle_head(target)
    window = MainWindow(device="cpu")
    window.errors = []
    window.show_error = lambda title, message: window.errors.append((title, message))
    qtbot.addWidget(window)
    window.show()
    window.start(str(target), str(tiny_pair_dirs[1]))
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)
    assert window.errors == [] and window.method_actions["eagle"].isEnabled()
    window.prompt.setPlainText(PROMPT)
    window.method_actions["eagle:8"].trigger()
    window.batch_action.trigger()
    assert window.errors[-1][0] == "No batched method" and not window.running
    window.method_actions["eagle"].trigger()
    window.k_actions[2].trigger()
    window.batch_sizes = (1, 2)
    window.batch_new_tokens = 6
    window.batch_action.trigger()
    qtbot.waitUntil(lambda: window.batch_dialog is not None, timeout=60000)
    qtbot.waitUntil(lambda: not window.running, timeout=10000)
    dialog = window.batch_dialog
    assert window.errors[1:] == [] and dialog.complete and dialog.report.method == "eagle"
    assert [r.batch for r in dialog.rows] == [1, 2] and all(r.draft_step_ms > 0 for r in dialog.rows)
    assert all(r.acceptance_rate > 0 for r in dialog.rows)


def test_a_run_that_loses_everywhere_reports_no_crossover_and_its_labels_stand_beside_the_lines(qtbot):
    """Issue 52: no 'crossover B ≈ 1.0' where speculation loses at every B; the names of the lines are not
    struck through by them; every column and row of the table in sight."""
    off = BatchDialog(None, make_report([0.9, 0.8, 0.7], 1.0), "title")
    qtbot.addWidget(off)
    assert off.crossover_line is None and "B ≈ 1.0" not in off.summary.text()
    assert "loses at every measured batch" in off.summary.text()
    speedups = [1.8, 1.5, 1.1, 0.8, 0.6]
    dialog = BatchDialog(None, make_report(speedups, roofline.crossover([1, 2, 4, 8, 16], speedups)), "t")
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    assert all(x <= 0 for x, _ in dialog.crossover_line.label.anchors)  # the text right of the line
    assert all(y >= 1 for _, y in dialog.unity_line.label.anchors)  # the text above the line
    table = dialog.table
    assert table.horizontalHeader().length() <= table.viewport().width()
    assert table.verticalHeader().length() <= table.viewport().height()
