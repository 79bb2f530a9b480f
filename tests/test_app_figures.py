"""Issue 52 in the real window: a tree method's lossless check, and one value per figure on every view."""
from __future__ import annotations

import sys

import pytest
from app_windows import open_real_window
from tiny_models import make_tiny_pair

from app import backend
from app.compare import COLUMNS
from app.main_window import GIL_SWITCH_INTERVAL_S

pytestmark = pytest.mark.usefixtures("isolated_qsettings")
backend.preload_engine()  # as run_gui does


@pytest.fixture(scope="module")
def tree_pair(tmp_path_factory):
    """The tiny pair, its target with an EAGLE head (so the EAGLE tree methods run)."""
    from test_tree_methods import add_random_eagle_head

    target, draft = make_tiny_pair(tmp_path_factory.mktemp("tree_pair"))
    add_random_eagle_head(target, 64)
    return str(target), str(draft)


@pytest.fixture
def tree_window(qtbot, tree_pair):
    previous = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    yield open_real_window(qtbot, *tree_pair)
    sys.setswitchinterval(previous)


def test_check_lossless_proves_a_tree_method(qtbot, tree_window):
    """EAGLE's tree (eagle:8) against plain decoding: the plain run takes no tree size (issue 52, item 2)."""
    window = tree_window
    assert window.method_actions["eagle:8"].isEnabled()
    window.method_actions["eagle:8"].trigger()
    window.max_tokens.setValue(16)
    window.prompt.setPlainText("def add(a, b):\n    return a + b\n")
    window.check_samples = 60
    window.check_action.trigger()
    qtbot.waitUntil(lambda: window.check_dialog is not None or bool(window.errors), timeout=120000)
    assert window.errors == []
    greedy = window.check_reports["greedy"]
    assert greedy.passed and greedy.tokens_compared == 16
    assert "greedy: PASS (16 generated" in window.check_dialog.text


def _show(qtbot, window, gen):
    """Show a History run as a click would, and wait for its diagnosis."""
    window.history.setCurrentRow(gen.index - 1)
    qtbot.waitUntil(lambda: not window.diagnosing and window.diagnosis.diagnosis is not None, timeout=30000)
    window.plots.redraw()


def _run(qtbot, window, spec):
    window.method_actions[spec].trigger()
    window.prompt.setPlainText(PROMPT)
    window.generate_button.click()
    qtbot.waitUntil(lambda: not window.running, timeout=60000)
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=30000)
    return window.session.generations[-1]


def _figures_on_screen(qtbot, window, gen) -> dict:
    """What each view shows for gen: TPOT_plain and its speedup, read from the widgets."""
    _show(qtbot, window, gen)
    status = window.status_labels["calibration"].text()
    summary = window.plots.summary.text()
    row = next(r for r in window.compare.rows if f"#{gen.index}" in r["runs"].split(", "))
    d = window.diagnosis.diagnosis
    return {"status": status, "summary": summary, "compare": row, "diagnosis": d,
            "diagnosis_html": window.diagnosis.toHtml(), "reference": window.plots.reference,
            "textbook": gen.buffers.textbook_tpot[-1] / gen.buffers.textbook_factors[-1]}


def _assert_one_value(shown: dict, gen, window):
    plain = window.plain_tpot(gen)
    factor = gen.events[-1].metrics.tokens_per_s / plain.tokens_per_s
    tpot = f"TPOT_plain {plain.ms:.2f} ms"
    assert tpot in shown["status"] and f"speedup {factor:.2f}×" in shown["status"]
    assert tpot in shown["summary"] and f"speedup measured <b>{factor:.2f}×" in shown["summary"]
    assert shown["compare"]["speedup"] == pytest.approx(factor)
    d = shown["diagnosis"]
    assert d.speedup == pytest.approx(factor) and f"({factor:.2f}×)" in d.verdict.title
    assert d.bars[0].per_token_ms == pytest.approx(plain.ms)
    assert d.verdict.title.startswith("faster" if factor >= 1 else "slower")
    assert shown["diagnosis_html"].index(d.verdict.title) < shown["diagnosis_html"].index("Where a round")
    assert shown["reference"][0] == pytest.approx(plain.ms) and plain.source in shown["reference"][1]
    assert shown["textbook"] == pytest.approx(plain.ms)
    return plain


PROMPT = "def add(a, b):\n    return a + b\n"


def test_every_view_shows_one_tpot_plain_and_one_speedup(qtbot, tree_window):
    """A session: a draft-model run (TPOT_plain from the calibration, labelled so), a plain run of the same
    prompt and settings (it replaces the calibration everywhere at once), then an EAGLE tree run: the status
    bar, Model vs measurement, Why is it slow?, Compare and the plots show the same TPOT_plain and speedup."""
    window = tree_window
    window.max_tokens.setValue(24)
    draft = _run(qtbot, window, "draft")
    window.compare_rows([0])
    before = _figures_on_screen(qtbot, window, draft)
    plain = _assert_one_value(before, draft, window)
    assert not plain.measured and "calibration" in before["status"] and "calibration" in before["summary"]
    assert plain.ms == pytest.approx(window.calibration.target_step_ms)
    assert "vs calibration" in window.compare.item(0, COLUMNS.index("speedup")).text()

    plain_run = _run(qtbot, window, "none")
    tree = _run(qtbot, window, "eagle:8")
    window.compare_rows([0, 1, 2])
    for gen in (draft, tree):
        shown = _figures_on_screen(qtbot, window, gen)
        plain = _assert_one_value(shown, gen, window)
        assert plain.measured and plain.runs == (plain_run.index,)
        assert plain.ms == pytest.approx(plain_run.events[-1].metrics.tpot_ms)
        assert "calibration" not in shown["status"]
    _show(qtbot, window, plain_run)
    assert "K=" not in window.plots.summary.text() and "plain decoding" in window.plots.summary.text()
    assert window.errors == []


def test_opening_a_target_keeps_a_draft_that_fits_and_says_what_it_changed(qtbot, tree_window, tiny_pair_dirs,
                                                                           tmp_path):
    """Item 5: a new target keeps the draft in use where it fits; where it does not, the target loads alone
    and a banner (which stays until dismissed) says so, and that the method went from Draft model to Off;
    the method comes back once a pair runs it."""
    from tiny_models import make_tiny_llama

    window = tree_window
    window.method_actions["draft"].trigger()
    draft = window.draft_path

    def open_target(path):
        window.ask_directory = lambda title: str(path)
        window.open_target_folder()
        qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)

    open_target(tiny_pair_dirs[0])
    assert (window.target_path, window.draft_path) == (str(tiny_pair_dirs[0]), draft)
    assert window.settings.config().method == "draft" and window.banner.isHidden()

    other = make_tiny_llama(tmp_path / "other", vocab=64)  # its own tokenizer: the draft does not fit it
    open_target(other)
    assert window.decoder is not None and window.draft_path is None and window.errors == []
    assert window.settings.config().method == "none"
    text = window.banner.label.text()
    assert window.banner.isVisible() and "does not fit" in text and "Method switched from Draft model" in text
    qtbot.wait(100)
    assert window.banner.isVisible()  # no timeout: it waits for the user

    window.load_models(str(tiny_pair_dirs[0]), draft)
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)
    assert window.settings.config().method == "draft"
    assert "Method back to Draft model" in window.banner.label.text()
    window.banner.dismiss_button.click()
    assert window.banner.isHidden()


def test_plots_come_back_after_the_window_was_small(qtbot):
    """Item 3: small (the plots become tabs) and large again: every plot is back in sight, twice over."""
    from app.plots import PlotPanel

    panel = PlotPanel()
    qtbot.addWidget(panel)
    panel.resize(1200, 500)
    panel.show()
    for _ in range(2):
        panel.set_compact(True)
        assert panel.tabs.count() == len(panel._widgets)
        panel.set_compact(False)
        assert all(widget.isVisible() for widget in panel._widgets)
        assert panel.tabs.count() == 0


def test_small_defects_of_item_6(qtbot, tree_window):
    """A finished run's tree is not "(live)"; the K menu names Ctrl+] and Ctrl+[; View → Why is it slow?
    raises the dock when it is open behind a tab instead of closing it; the fold mark has a glyph."""
    from PySide6.QtGui import QFontMetrics

    window = tree_window
    window.max_tokens.setValue(12)
    _run(qtbot, window, "eagle:8")
    assert "round" in window.tree_panel.position.text() and "(live)" not in window.tree_panel.position.text()
    assert "Ctrl+]" in window.menus.k_up_action.text() and "Ctrl+[" in window.menus.k_down_action.text()
    window.tabifyDockWidget(window.diagnosis_dock, window.inspector_dock)
    window.inspector_dock.raise_()
    qtbot.wait(50)
    view = next(a.menu() for a in window.menuBar().actions() if a.text() == "&View")
    action = next(a for a in view.actions() if a.text() == "Why is it slow?")
    action.trigger()
    qtbot.wait(50)
    assert window.diagnosis_dock.isVisible() and not window.diagnosis_dock.visibleRegion().isEmpty()
    assert action.isChecked()
    assert QFontMetrics(window.view.font()).inFontUcs4(ord("⋔"))
