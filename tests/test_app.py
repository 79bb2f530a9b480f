"""GUI tests against a fake decoder that yields hand-built RoundEvents (fast, deterministic)."""
from __future__ import annotations

import csv
import gc
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import pytest
from app_windows import answer_save, catch_errors, open_real_window
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QTextCursor

from app import backend, gc_guard
from app.compare import COLUMNS
from app.jobs import JobSlot
from app.main_window import GIL_SWITCH_INTERVAL_S, MainWindow
from app.round_view import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    PROMPT,
    REJECTED,
    TARGET,
    UNTESTED,
    TokenInfo,
    display_text,
    round_tokens,
)
from app.settings import AppSettings
from app.workers import Worker
from engine.core.metrics import MetricsAccumulator
from engine.errors import SpecplayError
from engine.events import DraftedToken, RoundEvent, RoundMetrics

pytestmark = pytest.mark.usefixtures("isolated_qsettings")
backend.preload_engine()  # as run_gui does: torch is imported once, on the main thread

TEXTS = ["def", " ", "f(x)", ":\n", "    ", "<b>&amp;", "\t", "return", " x", "\n"]


@dataclass
class FakeCalibration:
    target_step_ms: float = 2.0
    draft_step_ms: float = 0.5

    @property
    def c(self) -> float:
        return self.draft_step_ms / self.target_step_ms


def make_metrics(events, drafted, accepted, emitted) -> RoundMetrics:
    """The running metrics after this chain round, from the engine's accumulator (3 ms a round)."""
    metrics = MetricsAccumulator(drafted)
    for e in events:
        metrics.add_round(len(e.drafted), e.accepted_count, len(e.emitted_ids), len(e.drafted), 1.0, 1.5, 0.5)
    return metrics.add_round(drafted, accepted, emitted, drafted, 1.0, 1.5, 0.5)


def make_event(events, index: int, config, accepted: int, last: bool) -> RoundEvent:
    """A chain round: `accepted` drafts accepted out of K, then a correction or a bonus token."""
    k = 0 if config.method == "none" else config.k
    accepted = min(accepted, k)
    greedy = config.sampling.greedy
    drafted = []
    for depth in range(k):
        ok, tested = depth < accepted, depth <= accepted
        drafted.append(DraftedToken(
            token_id=depth, text=TEXTS[(index + depth) % len(TEXTS)], parent=depth - 1, depth=depth,
            p=0.5, q=0.25 if ok else 0.9, accept_prob=1.0 if ok else 0.5,
            u=None if greedy or not tested else (0.1 if ok else 0.8), accepted=ok, tested=tested,
            top=[("alt<1>", 0.4), (" ", 0.2)]))
    bonus = accepted == k
    emitted = list(range(accepted + 1))
    position = sum(len(e.emitted_ids) for e in events)
    return RoundEvent(
        round=index, method=config.method, k=config.k, drafted=drafted, accepted_count=accepted,
        next_token_id=99, next_token_text="\n" if index % 3 == 2 else "Z", next_is_bonus=bonus,
        next_token_p=0.7,
        next_top=[("Z", 0.7)], emitted_ids=emitted, emitted_text="", position=position, draft_ms=1.0,
        verify_ms=1.5, overhead_ms=0.5, finished=last, finish_reason="length" if last else None,
        metrics=make_metrics(events, len(drafted), accepted, len(emitted)))


class FakeDecoder:
    device_name = "FakeGPU 9000"

    def __init__(self, accepts=(2, 4, 0, 1, 3, 4, 1), rounds=None, delay=0.0, fail_at=None):
        self.accepts = accepts
        self.rounds = rounds or len(accepts)
        self.delay = delay
        self.fail_at = fail_at
        self.configs = []
        self.produced = []

    def method_availability(self):
        return {"none": None, "draft": None, "ngram": None, "medusa": "no Medusa heads in this model",
                "eagle": "no EAGLE head in this model", "lookahead": "not implemented in the engine yet"}

    def calibrate(self, k, sampling=None):
        return FakeCalibration()

    def prompt_ids(self, prompt):
        return [ord(c) for c in prompt]

    def generate(self, prompt, config, should_stop=None):
        self.configs.append(config)
        events = []
        self.produced = events
        for index in range(self.rounds):
            if should_stop is not None and should_stop():
                return
            if index == self.fail_at:
                raise RuntimeError("kernel exploded")
            time.sleep(self.delay)
            event = make_event(events, index, config, self.accepts[index % len(self.accepts)],
                               index == self.rounds - 1)
            events.append(event)
            yield event


@pytest.fixture
def make_window(qtbot):
    """make_window(decoder=None, loader=None) -> a shown MainWindow whose models have loaded; dialogs go to
    window.errors instead of message boxes."""
    def make(decoder=None, loader=None, start=True):
        decoder = decoder or FakeDecoder()
        window = MainWindow(loader=loader or (lambda target, draft, device: decoder), device="cpu")
        catch_errors(window)
        window.fake = decoder
        qtbot.addWidget(window)
        window.show()
        if start:
            window.start()
            qtbot.waitUntil(lambda: window.load_job is None, timeout=5000)
        return window

    return make


def generate(qtbot, window, prompt="def f(x):", wait=True):
    window.prompt.setPlainText("" if "\n" not in prompt else prompt)  # QTest cannot type a newline
    if "\n" not in prompt:
        qtbot.keyClicks(window.prompt, prompt)
    qtbot.keyClick(window.prompt, Qt.Key_Return, Qt.ControlModifier)
    if wait:
        qtbot.waitUntil(lambda: not window.running, timeout=5000)


def expected_spans(prompt, events):
    spans = [(PROMPT, display_text(TokenInfo(PROMPT, -1, prompt)), -1)]
    for event in events:
        spans += [(info.kind, display_text(info), event.round) for info in round_tokens(event)]
    return spans


def test_generate_renders_every_round_in_place(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    events = window.session.generations[0].events
    assert len(events) == window.fake.rounds
    spans = window.view.rendered_spans()
    assert spans[:-1] == expected_spans("def f(x):", events)
    assert spans[-1][0] == "notice" and "length" in spans[-1][1]
    kinds = {kind for kind, _, _ in spans}
    assert {ACCEPTED, REJECTED, UNTESTED, CORRECTION, BONUS} <= kinds
    # round 1 accepts all 4 drafts (bonus); round 2 rejects the first draft and corrects it
    round2 = [s for s in spans if s[2] == 2]
    assert [k for k, _, _ in round2] == [REJECTED, UNTESTED, UNTESTED, UNTESTED, CORRECTION]
    assert [k for k, _, r in spans if r == 1][-1] == BONUS


def test_whitespace_and_markup_render_literally(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    text = window.view.toPlainText()
    assert "<b>&amp;" in text  # never interpreted as HTML
    spans = window.view.rendered_spans()
    newline_tokens = [t for k, t, _ in spans if k in (ACCEPTED, CORRECTION, BONUS) and "↵" in t]
    assert newline_tokens and all(t.endswith("↵\n") for t in newline_tokens)
    rejected = [t for k, t, _ in spans if k in (REJECTED, UNTESTED)]
    assert all("\n" not in t for t in rejected)  # rejected newlines are marked, not broken
    assert any(k == ACCEPTED and t == "    " for k, t, _ in spans)  # spaces kept as they are


def test_hover_and_click_show_token_details(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    view = window.view
    index = next(i for i, info in enumerate(view.tokens) if info.kind == REJECTED and info.u is None)
    rect = view.cursorRect(_cursor_for_token(view, index))
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=QPoint(rect.right() + 2, rect.center().y()))
    html = window.inspector.toPlainText()
    # greedy: the argmax rule; q and min(1, p/q) are not shown beside p (they play no part)
    assert "p(x) = 0.5000" in html and "q(x)" not in html and "min(1, p/q)" not in html
    assert "is not the target's argmax" in html and "Greedy (T = 0)" in html
    assert "rejected" in html and "alt<1>" in html and f"round {view.tokens[index].round + 1}" in html


def _cursor_for_token(view, index: int) -> QTextCursor:
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().anchorHref() == f"t{index}":
                cursor = QTextCursor(view.document())
                cursor.setPosition(frag.position())
                return cursor
            it += 1
        block = block.next()
    raise AssertionError(f"token {index} not rendered")


def tree_round():
    """A tree round: two roots; the first accepted, then its first child; the grandchild rejected."""
    from dataclasses import replace

    from engine.config import GenerationConfig

    base = make_event([], 0, GenerationConfig(method="medusa", k=4), 2, False)
    spec = [(-1, 0, True, True), (-1, 0, False, True), (0, 1, True, True), (0, 1, False, True),
            (2, 2, False, True)]  # (parent, depth, accepted, tested)
    drafted = [DraftedToken(token_id=i, text=f"t{i}", parent=p, depth=d, p=0.5, q=1.0, accept_prob=0.5,
                            u=None, accepted=a, tested=t, top=[]) for i, (p, d, a, t) in enumerate(spec)]
    return replace(base, drafted=drafted, accepted_count=2, emitted_ids=[0, 2, 99], next_is_bonus=False)


def test_tree_layout_puts_every_draft_at_its_depth_and_the_correction_on_the_path():
    from app.tree_view import ROOT, tree_layout

    nodes = tree_layout(tree_round())
    assert [n.kind for n in nodes] == [ROOT, ACCEPTED, REJECTED, ACCEPTED, REJECTED, REJECTED, CORRECTION]
    assert [n.column for n in nodes] == [0, 1, 1, 2, 2, 3, 3]
    assert [n.parent for n in nodes] == [None, 0, 0, 1, 1, 3, 3]
    # depth-first leaves: t4, the correction, t3, t1; parents sit on their first child's row
    assert [n.row for n in nodes] == [0, 0, 3, 0, 2, 0, 1]


def test_tree_layout_of_a_chain_is_one_line(qtbot, make_window):
    from app.tree_view import tree_layout

    window = make_window(FakeDecoder(accepts=(4,)))
    generate(qtbot, window)
    nodes = tree_layout(window.session.generations[0].events[0])
    assert [n.row for n in nodes] == [0] * 6 and [n.column for n in nodes] == list(range(6))
    assert nodes[-1].kind == BONUS


def test_draft_tree_follows_the_run_and_the_clicked_round(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    gen = window.session.generations[0]
    tree = window.tree_view
    assert tree.event is gen.events[-1] and len(tree.nodes) == len(gen.events[-1].drafted) + 2
    view = window.view
    index = next(i for i, info in enumerate(view.tokens) if info.round == 1)
    rect = view.cursorRect(_cursor_for_token(view, index))
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=QPoint(rect.right() + 2, rect.center().y()))
    assert tree.event is gen.events[1]
    box = tree._boxes[-1]  # the round's correction or bonus token
    qtbot.mouseClick(tree, Qt.LeftButton, pos=box.center().toPoint())
    assert "round 2" in window.inspector.toPlainText() and tree.nodes[-1].info.kind in (CORRECTION, BONUS)
    assert not tree.grab().isNull()


def test_sampled_round_shows_uniform(qtbot, make_window):
    window = make_window()
    window.apply_sampling({"decode/greedy": False, "decode/temperature": 0.7, "decode/seed": 5})
    generate(qtbot, window)
    config = window.fake.configs[-1]
    assert config.sampling.temperature == pytest.approx(0.7) and config.seed == 5
    info = next(i for i in window.view.tokens if i.kind == ACCEPTED)
    from app.round_view import describe
    assert "u = 0.1000" in describe(info) and "accepted" in describe(info)
    assert "q(x) = 0.2500" in describe(info) and "min(1, p/q) = 1.0000" in describe(info)


def test_method_and_k_from_menus_apply_to_next_run(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    assert window.fake.configs[-1].method == "draft" and window.fake.configs[-1].k == 4
    window.method_actions["ngram"].trigger()
    window.k_actions[7].trigger()
    generate(qtbot, window)
    assert (window.fake.configs[-1].method, window.fake.configs[-1].k) == ("ngram", 7)
    window.method_actions["none"].trigger()
    generate(qtbot, window)
    assert window.fake.configs[-1].method == "none"
    assert {k for k, _, _ in window.view.rendered_spans()} <= {PROMPT, TARGET, "notice"}
    labels = [window.history.item(i).text() for i in range(window.history.count())]
    assert "Draft model K=4" in labels[0] and "N-gram prompt lookup K=7" in labels[1] and "Off" in labels[2]
    # selecting an earlier generation shows it again
    window.history.setCurrentRow(0)
    first = window.session.generations[0]
    assert window.view.rendered_spans()[:-1] == expected_spans("def f(x):", first.events)


def test_eagle_tree_entry_runs_eagle_with_a_tree_of_8_nodes(qtbot, make_window):
    window = make_window()
    assert not window.method_actions["eagle:8"].isEnabled()  # the fake has no EAGLE head
    window.availability["eagle"] = None
    window._refresh_menus()
    assert window.method_actions["eagle:8"].isEnabled()
    window.method_actions["eagle:8"].trigger()
    window.k_actions[3].trigger()
    generate(qtbot, window)
    config = window.fake.configs[-1]
    assert (config.method, config.k, config.tree_nodes) == ("eagle", 3, 8)  # the spec fixes the size
    assert "dynamic tree of 8 nodes" in window.history.item(window.history.count() - 1).text()


def test_find_the_fastest_k_measures_each_k_and_offers_the_best(qtbot, make_window, tmp_path):
    from app.main_window import SWEEP_KS

    window = make_window()
    window.method_actions["draft"].trigger()
    window.prompt.setPlainText("def f(x):")
    window.max_tokens.setValue(12)
    window.sweep_action.trigger()
    assert window.running and not window.generate_button.isEnabled() and not window.sweep_action.isEnabled()
    qtbot.waitUntil(lambda: window.sweep_dialog is not None, timeout=20000)
    assert not window.running and window.errors == []
    rows = window.sweep_rows
    assert [row["k"] for row in rows] == list(SWEEP_KS)
    assert {config.k for config in window.fake.configs} >= set(SWEEP_KS)  # every K really ran
    assert all(config.method in ("draft", "none") for config in window.fake.configs)
    dialog = window.sweep_dialog
    best = max(rows, key=lambda row: row["speedup"])["k"]
    assert dialog.best == best and dialog.table.rowCount() == len(SWEEP_KS)
    assert dialog.table.item(0, 0).text() == "1"
    answer_save(window, tmp_path / "ks.csv")
    dialog.save_button.click()
    with open(tmp_path / "ks.csv", newline="") as handle:
        assert [int(row["k"]) for row in csv.DictReader(handle)] == list(SWEEP_KS)
    dialog.use_button.click()
    assert window.settings.get("decode/k") == best and window.k_actions[best].isChecked()


def test_find_the_fastest_method_measures_each_runnable_method_and_offers_the_best(qtbot, make_window,
                                                                                   tmp_path):
    """Method → Find the fastest method: every menu method the decoder can run, at the menus' K, beside plain
    decoding; the others named with their reason; the fastest offered."""
    from app.settings import METHOD_KEY

    window = make_window()
    window.prompt.setPlainText("def f(x):")
    window.max_tokens.setValue(12)
    window.k_actions[3].trigger()
    window.method_sweep_action.trigger()
    assert window.running and not window.method_sweep_action.isEnabled()
    assert not window.sweep_action.isEnabled()
    qtbot.waitUntil(lambda: window.method_dialog is not None, timeout=20000)
    assert not window.running and window.errors == []
    rows = window.method_sweep_rows
    assert [row["method"] for row in rows] == ["none", "draft", "ngram"]  # what the fake decoder offers
    assert {c.method for c in window.fake.configs} == {"none", "draft", "ngram"}
    assert {c.k for c in window.fake.configs} == {3}
    dialog = window.method_dialog
    best = max(rows[1:], key=lambda row: row["speedup"])["method"]
    assert dialog.best == best and dialog.table.rowCount() == 3
    assert dialog.table.item(0, 0).text() == "Off (plain autoregressive)"
    assert dialog.table.item(0, 1).text() == "–"  # plain decoding drafts nothing: no α
    assert "Not measured: Medusa: no Medusa heads in this model" in dialog.summary.text()
    answer_save(window, tmp_path / "methods")  # the suffix is added
    dialog.save_button.click()
    with open(tmp_path / "methods.csv", newline="") as handle:
        saved = list(csv.DictReader(handle))
    assert [row["method"] for row in saved] == ["none", "draft", "ngram"]
    assert [float(row["speedup"]) for row in saved] == pytest.approx([row["speedup"] for row in rows])
    assert window.errors == [] and dialog.isVisible()  # saving keeps the dialog open
    dialog.use_button.click()
    assert window.settings.get(METHOD_KEY) == best and window.method_actions[best].isChecked()


def _stopped_method_sweep(qtbot, window, generations: int) -> None:
    """Find the fastest method, stopped once `generations` generations (warm-ups first) have started."""
    window.prompt.setPlainText("def f(x):")
    window.method_sweep_action.trigger()
    qtbot.waitUntil(lambda: len(window.fake.configs) >= generations, timeout=10000)
    window.stop()
    qtbot.waitUntil(lambda: not window.running, timeout=10000)


def test_a_method_sweep_stopped_while_warming_up_shows_nothing(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=40, delay=0.01))
    _stopped_method_sweep(qtbot, window, 2)
    assert window.method_dialog is None and window.method_sweep_rows == [] and window.errors == []
    assert len(window.fake.configs) < 6  # 3 warm-ups and 3 measured generations when not stopped
    assert "measured nothing" in window.statusBar().currentMessage()


def test_a_stopped_method_sweep_shows_what_it_measured_and_recommends_none(qtbot, make_window):
    """Plain decoding, draft model and n-gram: stopped while the draft model's measured run goes on."""
    window = make_window(FakeDecoder(rounds=40, delay=0.01))
    _stopped_method_sweep(qtbot, window, 5)
    qtbot.waitUntil(lambda: window.method_dialog is not None, timeout=10000)
    dialog = window.method_dialog
    assert [row["method"] for row in window.method_sweep_rows] == ["none", "draft"]
    assert not dialog.complete and dialog.use_button is None and dialog.best is None
    assert dialog.table.rowCount() == 2 and "recommends none" in dialog.summary.text()


def test_a_k_sweep_on_a_drifting_machine_sweeps_again_and_shows_the_steadiest(qtbot, make_window,
                                                                              monkeypatch):
    """The first sweep's plain runs drift (the steadiness warning): the window clears its rows, sweeps again,
    and the dialog shows the second, steady sweep without the warning."""
    from app.main_window import SWEEP_KS
    from engine.bench import suite as bench

    def sweep(plain, speedup):
        calibrated_ms = 1000 / plain[0]
        return [{"k": k, "alpha": 0.5, "tokens_per_forward": 2.0, "tokens_per_s": 100.0,
                 "speedup": speedup + k / 100, "plain_tokens_per_s": p, "calibrated_plain_ms": calibrated_ms}
                for k, p in zip(SWEEP_KS, plain)]

    sweeps = [sweep([3000, 2000, 3000, 3000, 3000, 3000], 1.0), sweep([3000] * 6, 2.0)]
    seen = []

    def canned(decoder, prompts, base, ks, repeats=1, progress=None):
        rows = sweeps.pop(0)
        for row in rows:
            progress(row)
        seen.append(len(rows))
        return rows

    monkeypatch.setattr(bench, "bench_k_sweep", canned)
    window = make_window()
    window.method_actions["draft"].trigger()
    window.prompt.setPlainText("def f(x):")
    window.sweep_action.trigger()
    qtbot.waitUntil(lambda: window.sweep_dialog is not None, timeout=20000)
    assert seen == [6, 6] and window.errors == []
    assert [row["speedup"] for row in window.sweep_rows] == [2.0 + k / 100 for k in SWEEP_KS]
    assert "speed moved" not in window.sweep_dialog.summary.text()
    assert window.sweep_dialog.best == SWEEP_KS[-1]


@pytest.mark.parametrize("task", ["sweep_action", "check_action"])  # Find the fastest K, Check lossless
def test_drafting_tasks_need_a_drafting_method_and_a_prompt(qtbot, make_window, task):
    window = make_window()
    window.method_actions["none"].trigger()
    window.prompt.setPlainText("def f(x):")
    getattr(window, task).trigger()
    assert window.errors[-1][0] == "No drafting method" and not window.running
    window.method_actions["draft"].trigger()
    window.prompt.setPlainText("   ")
    getattr(window, task).trigger()
    assert window.errors[-1][0] == "Empty prompt" and not window.running


def test_a_k_sweep_stops_after_the_k_it_is_measuring(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=40, delay=0.01))
    window.method_actions["draft"].trigger()
    window.prompt.setPlainText("def f(x):")
    window.sweep_action.trigger()
    qtbot.waitUntil(lambda: len(window.sweep_rows) >= 1, timeout=20000)
    qtbot.keyClick(window.prompt, Qt.Key_Escape)
    qtbot.waitUntil(lambda: not window.running, timeout=20000)
    assert 1 <= len(window.sweep_rows) < 6


def test_unavailable_methods_are_disabled_with_reason(qtbot, make_window):
    window = make_window()
    medusa = window.method_actions["medusa"]
    assert not medusa.isEnabled() and "no Medusa heads" in medusa.toolTip()
    assert window.method_actions["draft"].isEnabled()
    assert "FakeGPU 9000" in window.status_labels["device"].text()
    assert "c 0.25" in window.status_labels["calibration"].text()


def test_export_csv_and_jsonl(qtbot, make_window, tmp_path):
    window = make_window()
    generate(qtbot, window)
    generate(qtbot, window)
    path = tmp_path / "metrics.csv"
    answer_save(window, path)
    window.export_csv()
    rows = list(csv.reader(path.open()))
    assert rows[0][:2] == ["generation", "round"]
    assert len(rows) == 1 + 2 * window.fake.rounds
    assert [r[0] for r in rows[1:]] == ["1"] * window.fake.rounds + ["2"] * window.fake.rounds
    answer_save(window, tmp_path / "trace.jsonl")
    window.export_jsonl()
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 2 + 2 * window.fake.rounds
    answer_save(window, tmp_path / "plots.png")
    window.export_plots()
    assert (tmp_path / "plots.png").stat().st_size > 0
    answer_save(window, tmp_path / "plots.svg")
    window.export_plots()
    assert "<svg" in (tmp_path / "plots.svg").read_text()
    assert window.errors == []


def test_unwritable_export_gives_dialog_and_keeps_session(qtbot, make_window, tmp_path):
    window = make_window()
    generate(qtbot, window)
    answer_save(window, tmp_path / "missing" / "dir" / "m.csv")
    window.export_csv()
    window.export_plots()
    assert len(window.errors) == 2 and "cannot write" in window.errors[0][1]
    assert len(window.session.generations) == 1


def test_stop_mid_run_within_one_round(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=500, delay=0.01))
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 3, timeout=5000)
    qtbot.keyClick(window.prompt, Qt.Key_Escape)
    qtbot.waitUntil(lambda: not window.running, timeout=2000)
    gen = window.session.generations[0]
    assert gen.finish == "stopped" and len(gen.events) < 500
    assert window.view.rendered_spans()[-1][1].strip() == "[stopped]"


def test_empty_prompt_gives_dialog(qtbot, make_window):
    window = make_window()
    generate(qtbot, window, prompt="   ")
    assert window.errors and window.errors[0][0] == "Empty prompt"
    assert window.session.generations == []


def test_engine_failure_gives_dialog_and_keeps_data(qtbot, make_window):
    window = make_window(FakeDecoder(fail_at=3))
    generate(qtbot, window)
    assert window.errors == [("Generation failed", "The engine failed: RuntimeError: kernel exploded")]
    gen = window.session.generations[0]
    assert gen.finish == "error" and len(gen.events) == 3
    window.fake.fail_at = None
    generate(qtbot, window)  # the session carries on
    assert len(window.session.generations) == 2 and window.session.generations[1].finish == "length"


def test_bad_model_folder_gives_dialog(qtbot, make_window, tmp_path):
    window = make_window(loader=backend.load_decoder, start=False)
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    (bad / "readme.txt").write_text("hello")
    window.ask_directory = lambda title: str(bad)
    window.open_target_folder()
    qtbot.waitUntil(lambda: window.load_job is None, timeout=30000)  # the first load imports torch
    assert len(window.errors) == 1 and window.errors[0][0] == "Could not load the models"
    assert "not_a_model" in window.errors[0][1]
    assert window.decoder is None and "Open target folder" in window.view.toPlainText()


def test_missing_models_still_open_with_help(qtbot, make_window):
    def missing(target, draft, device):
        raise SpecplayError("No shipped models in assets/models yet")

    window = make_window(loader=missing)
    assert window.errors == []  # quiet at start-up: the view explains instead
    text = window.view.toPlainText()
    assert "Open target folder" in text and "No shipped models" in text
    generate(qtbot, window)
    assert window.errors[0][0] == "No model loaded"


def test_settings_persist_and_reset(qtbot, make_window):
    window = make_window()
    window.method_actions["ngram"].trigger()
    window.k_actions[9].trigger()
    window.greedy_action.trigger()  # greedy off
    window.plots_action.trigger()  # plots off
    window.close()
    again = make_window()
    config = AppSettings().config()
    assert (config.method, config.k, config.sampling.greedy) == ("ngram", 9, False)
    assert again.method_actions["ngram"].isChecked() and again.k_actions[9].isChecked()
    assert not again.plots_dock.isVisible()
    again.reset_settings()
    config = AppSettings().config()
    assert (config.method, config.k, config.sampling.greedy) == ("draft", 4, True)
    assert again.k_actions[4].isChecked() and again.plots_dock.isVisible()


def stored_settings():
    """The QSettings file the window reads (redirected to a temp dir by isolated_qsettings)."""
    from PySide6.QtCore import QSettings

    from app.settings import APPLICATION, ORGANIZATION

    return QSettings(QSettings.IniFormat, QSettings.UserScope, ORGANIZATION, APPLICATION)


def test_a_stored_eagle_tree_is_migrated_to_eagle_8(make_window):
    """Before the method registry the Method menu stored EAGLE's tree as 'eagle-tree' (2K nodes)."""
    old = stored_settings()
    old.setValue("decode/method", "eagle-tree")
    old.setValue("decode/k", 3)
    old.sync()
    settings = AppSettings()
    assert settings.get("decode/method") == "eagle:8"
    config = settings.config()
    assert (config.method, config.k, config.tree_nodes) == ("eagle", 3, 8)
    settings.sync()
    assert stored_settings().value("decode/method") == "eagle:8"  # rewritten in the file as it was read
    window = make_window(start=False)
    assert window.method_actions["eagle:8"].isChecked()


def test_an_unknown_stored_method_reads_as_the_default():
    stored = stored_settings()
    stored.setValue("decode/method", "warp-drive")
    stored.sync()
    assert AppSettings().get("decode/method") == "draft" and AppSettings().config().method == "draft"


def test_method_menu_comes_from_the_registry(make_window):
    from engine.methods.registry import MENU_SPECS, parse_spec, spec_label

    window = make_window(start=False)
    assert list(window.method_actions) == list(MENU_SPECS)
    for spec, action in window.method_actions.items():
        parsed = parse_spec(spec)
        assert action.text() == spec_label(parsed.name, parsed.tree_nodes) and action.data() == spec
    # Ctrl+1 .. Ctrl+9 for the first nine (Ctrl+10 is no key sequence), none for the rest
    shortcuts = [action.shortcut().toString() for action in window.method_actions.values()]
    assert shortcuts == [f"Ctrl+{n}" for n in range(1, 10)] + [""] * (len(MENU_SPECS) - 9)
    window.method_actions["eagle:8"].trigger()
    assert AppSettings().get("decode/method") == "eagle:8"
    assert "EAGLE, dynamic tree of 8 nodes, K=4" in window.status_labels["method"].text()


def test_plots_redraw_on_timer_not_per_event(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=300))
    generate(qtbot, window)
    plots = window.plots
    def plotted():
        x = plots.curves["running_alpha"].getData()[0]
        return 0 if x is None else len(x)

    qtbot.waitUntil(lambda: plotted() == 300, timeout=3000)
    assert plots.redraws < 150  # 300 events: the 20 Hz timer redraws one plot a tick
    assert len(plots.buffers.per_position_acceptance) == 4
    expected = 2.0 * (1 + 0.25 * 4) / plots.buffers.analytic_tpf[-1]  # TPOT_plain (1 + cK) / E
    assert plots.buffers.predicted_tpot[-1] == pytest.approx(expected)


class PaintCounter:
    """Counts paint events per plot viewport."""

    def __init__(self, plots):
        from PySide6.QtCore import QEvent, QObject

        counts = self.counts = {}

        class Filter(QObject):
            def eventFilter(self, watched, event):
                if event.type() == QEvent.Paint:
                    counts[watched] = counts.get(watched, 0) + 1
                return False

        self.filter = Filter()
        self.viewports = [plots.grid.itemAt(index).widget().viewport() for index in range(5)]
        for viewport in self.viewports:
            viewport.installEventFilter(self.filter)

    def painted(self) -> list:
        return [self.counts.get(viewport, 0) for viewport in self.viewports]


def test_new_summary_text_never_relayouts_the_plots(qtbot, make_window):
    """A label that asked for a new size on every text change would resize, and so repaint, all five plots
    each time the summary is redrawn (a 100 ms stall on a slow machine)."""
    window = make_window()
    plots = window.plots
    widgets = [plots.grid.itemAt(index).widget() for index in range(5)]
    qtbot.wait(50)
    sizes = [widget.size() for widget in widgets]
    counter = PaintCounter(plots)
    plots.summary.setText("<br>".join(["a long summary line that wraps over the width of its cell"] * 30))
    qtbot.wait(50)
    assert [widget.size() for widget in widgets] == sizes
    assert counter.painted() == [0] * 5
    # the text taller than its cell scrolls there, none of it cut off
    assert plots.summary_area.verticalScrollBar().maximum() > 0
    assert plots.summary.height() > plots.summary_area.viewport().height()


def test_redrawing_one_plot_repaints_only_that_plot(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=40))
    generate(qtbot, window)
    window.ui_timer.stop()
    plots = window.plots
    plots.redraw()
    counter = PaintCounter(plots)
    for _ in range(20):  # let the full redraw's paints (and any relayout after them) settle
        before = counter.painted()
        qtbot.wait(100)
        if counter.painted() == before:
            break
    counter.counts.clear()
    plots.buffers.version += 1
    plots.redraw_if_dirty()
    qtbot.waitUntil(lambda: sum(counter.painted()) > 0, timeout=2000)
    qtbot.wait(100)
    painted = counter.painted()
    assert sum(1 for count in painted if count) == 1, painted


def test_ui_ticks_alternate_between_text_and_plots(make_window, monkeypatch):
    """Drawing rounds and redrawing a plot in the same event-loop pass made the longest stalls."""
    window = make_window()
    window.ui_timer.stop()
    calls = []
    monkeypatch.setattr(window, "_flush_rounds", lambda: calls.append("text"))
    monkeypatch.setattr(window.plots, "redraw_if_dirty", lambda: calls.append("plot"))
    for _ in range(6):
        window._ui_tick()
    assert calls in (["text", "plot"] * 3, ["plot", "text"] * 3)


def test_live_status_label_does_not_shrink(make_window):
    """Live text (α, tok/s) that shrank and grew would relayout the whole status bar on every tick."""
    window = make_window()
    label = window.status_labels["live"]
    label.setText("α 0.55 · 12345 tok/s")
    wide = label.sizeHint().width()
    label.setText("α —")
    assert label.sizeHint().width() == wide


class AllocatingDecoder(FakeDecoder):
    """Allocates enough container objects per round to trip the automatic collector many times over."""

    def generate(self, prompt, config, should_stop=None):
        for event in super().generate(prompt, config, should_stop):
            event.scratch = [[index] for index in range(5000)]  # 5000 tracked lists: 7x the gen-0 threshold
            yield event


def test_garbage_is_collected_on_the_gui_thread_only(qtbot, make_window):
    """A collection on the decoding thread destroyed dead Qt objects there, and Shiboken deadlocked (CI hung
    for 90 minutes in this file). Dead Qt objects must be gone before a worker starts, and no collection may
    run on it."""
    from PySide6.QtWidgets import QMenu

    window = make_window(AllocatingDecoder(rounds=40))
    collecting_threads = set()

    def on_gc(phase, info):
        if phase == "start":
            collecting_threads.add(threading.get_ident())

    gc.disable()  # keep the cycle below as garbage until the window's own collection
    try:
        menu = QMenu()
        menu.cycle = menu  # a reference cycle holding a Qt object, like a closed window's lambdas
        dead_menu = weakref.ref(menu)
        del menu
    finally:
        gc.enable()
    gc.callbacks.append(on_gc)
    try:
        window.prompt.setPlainText("def f(x):")
        window.generate()
        assert dead_menu() is None  # collected on this (the GUI) thread before the worker started
        qtbot.waitUntil(lambda: not window.running, timeout=10000)
        qtbot.waitUntil(lambda: not window.diagnosing, timeout=10000)  # the diagnosis is a worker too
    finally:
        gc.callbacks.remove(on_gc)
    assert len(window.session.generations[0].events) == 40
    assert collecting_threads == {threading.get_ident()}  # young generations were collected, here only
    assert gc.isenabled()  # automatic collection is back once the worker has ended


def test_close_mid_run_exits_cleanly(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=10000, delay=0.005))
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 2, timeout=5000)
    thread = window.gen_job.thread
    window.close()
    assert not thread.is_alive() and window.gen_job is None


def test_clear_and_theme(qtbot, make_window):
    window = make_window()
    generate(qtbot, window)
    window.theme_actions["dark"].trigger()
    assert window.view.colors.accepted_bg == "#1f5130"
    assert window.view.rendered_spans()[0][0] == PROMPT  # re-rendered in the new colours
    window.theme_actions["light"].trigger()
    window.clear_session()
    assert window.session.generations == [] and window.history.count() == 0
    assert window.view.toPlainText() == ""


# ------------------------------------------------------------------------------------------------------------
# The job slot (app/jobs.py), on fake workers


class WaitingWorker(Worker):
    """Posts ("hello", 1), then waits until it is stopped and posts ("bye",)."""

    def __init__(self):
        super().__init__()
        self.started = threading.Event()

    def work(self) -> None:
        self.post("hello", 1)
        self.started.set()
        while not self.stop_requested:
            time.sleep(0.001)
        self.post("bye")


class QuickWorker(Worker):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def work(self) -> None:
        self.post("value", self.value)


def test_job_slot_starts_delivers_stops_and_finishes():
    slot = JobSlot("test")
    got, done = [], []
    worker = WaitingWorker()
    job = slot.start(worker, hello=lambda n: got.append(("hello", n)), bye=lambda: got.append("bye"),
                     done=done.append)
    assert slot.busy and slot.job is job and gc_guard.held()  # no automatic collection while it runs
    with pytest.raises(RuntimeError):
        slot.start(QuickWorker(0))
    assert worker.started.wait(5)
    assert got == []  # messages wait in the mailbox until the UI tick delivers them
    slot.deliver()
    assert got == [("hello", 1)] and done == [] and slot.busy
    assert slot.stop() and worker.stop_requested
    job.thread.join(5)
    assert got == [("hello", 1)] and slot.busy  # ended, but not joined until its "done" is delivered
    slot.deliver()
    assert got == [("hello", 1), "bye"] and done == [job]
    assert not slot.busy and not job.thread.is_alive() and not gc_guard.held()
    assert not slot.stop() and slot.finish() is None  # an idle slot


def test_job_slot_reports_a_failure_then_done():
    class Failing(Worker):
        def work(self):
            raise SpecplayError("no such model")

    slot = JobSlot("test")
    got = []
    job = slot.start(Failing(), failed=got.append, done=lambda finished: got.append(finished))
    job.thread.join(5)
    slot.deliver()
    assert got == ["no such model", job] and not slot.busy


def test_job_slot_done_handler_may_start_the_next_job():
    slot = JobSlot("test")
    values = []

    def next_job(finished) -> None:
        if finished.worker.value < 3:
            slot.start(QuickWorker(finished.worker.value + 1), value=values.append, done=next_job)

    slot.start(QuickWorker(1), value=values.append, done=next_job)
    deadline = time.monotonic() + 5
    while slot.busy and time.monotonic() < deadline:
        slot.deliver()
        time.sleep(0.001)
    assert values == [1, 2, 3] and not slot.busy and not gc_guard.held()


def test_job_slot_finish_joins_a_running_job_without_its_done_handler():
    """Closing the window stops and joins every slot; a "done" left in the mailbox is never handled."""
    slot = JobSlot("test")
    done = []
    worker = WaitingWorker()
    job = slot.start(worker, done=done.append)
    assert worker.started.wait(5)
    slot.stop()
    assert slot.finish() is job and not slot.busy and not job.thread.is_alive()
    slot.deliver()
    assert done == [] and not gc_guard.held()


# ------------------------------------------------------------------------------------------------------------
# The real engine, with tiny random models


class StallMonitor:
    """Longest gap between ticks of a 5 ms timer: how long the event loop went without running."""

    def __init__(self):
        from PySide6.QtCore import QTimer

        self.gaps = []
        self.last = time.perf_counter()
        self.timer = QTimer()
        self.timer.setInterval(5)
        self.timer.timeout.connect(self._tick)
        self.timer.start()

    def _tick(self):
        now = time.perf_counter()
        self.gaps.append(now - self.last)
        self.last = now

    def stop(self) -> float:
        self.timer.stop()
        return max(self.gaps[1:], default=0.0)


@pytest.fixture
def real_window(qtbot, tiny_pair_dirs):
    target, draft = tiny_pair_dirs
    previous = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as run_gui does
    yield open_real_window(qtbot, target, draft)
    sys.setswitchinterval(previous)


def test_real_decoder_renders_rounds_without_stalling(qtbot, real_window):
    window = real_window
    assert window.status_labels["device"].text() == "Device: CPU"
    assert "TPOT_plain" in window.status_labels["calibration"].text() and "—" not in \
        window.status_labels["calibration"].text()
    assert window.method_actions["draft"].isEnabled() and not window.method_actions["eagle"].isEnabled()
    window.k_actions[3].trigger()
    window.max_tokens.setValue(80)
    monitor = StallMonitor()
    generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    worst = monitor.stop()
    gen = window.session.generations[0]
    assert gen.finish in ("length", "eos") and gen.tokens <= 80
    assert all(e.k == 3 and e.method == "draft" for e in gen.events)
    assert window.view.rendered_spans()[:-1] == expected_spans(gen.prompt, gen.events)
    # The bound is 50 ms; alone on a 2-core machine this test measured 28-46 ms
    # (scripts/stall_probe.py, at tag before-house-cleanup: 27-37 ms). The decoder thread shares the GIL and
    # the cores with the GUI thread,
    # and with another test run beside it the same machine measured 142 ms, so this asserts only a gross
    # stall, to stay stable on CI. The measured worst gap is printed for the record (run with -s).
    print(f"worst event-loop gap while decoding: {worst * 1000:.0f} ms")
    assert worst < 0.25, f"event loop stalled for {worst * 1000:.0f} ms"


def test_a_suffix_generations_diagnosis_replays_it_from_the_sessions_memory(qtbot, real_window):
    """The window knows what suffix decoding's memory held as a generation began: the diagnosis predicts
    every K by replaying the generation, and at the run's own K it gives the run's tokens per forward."""
    window = real_window
    window.method_actions["suffix"].trigger()
    window.max_tokens.setValue(40)
    for _ in range(2):  # the second generation drafts from the first, in the session's memory
        generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    gen = window.session.generations[-1]
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    report = window.diagnosis.diagnosis.report
    assert gen.suffix_replay is not None and len(gen.suffix_replay[0]) == 1
    assert {p.basis for p in report.predictions} == {"exact (replayed)"}
    own = next(p for p in report.predictions if p.k == gen.config.k)
    assert own.tokens_per_forward == pytest.approx(gen.tokens / len(gen.events))
    window.history.setCurrentRow(0)  # the first generation, picked again: its own replay
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    assert window.diagnosis.diagnosis.report.predictions[0].basis == "exact (replayed)"


def test_clearing_the_session_clears_suffix_decodings_memory(qtbot, real_window):
    """Session → Clear forgets the generations for suffix decoding too: the next one begins with an empty
    memory, as the first of a session does."""
    window = real_window
    window.method_actions["suffix"].trigger()
    window.max_tokens.setValue(24)
    for _ in range(2):
        generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    assert len(window.session.generations[-1].suffix_replay[0]) == 1  # the first generation, remembered
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    window.clear_session()
    generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    assert len(window.session.generations) == 1 and window.session.generations[0].suffix_replay[0] == []


def test_suffix_decoding_goes_on_from_an_opened_or_reloaded_session(qtbot, real_window, tmp_path):
    """The session's suffix generations stay suffix decoding's memory: opened from a trace after a Clear, and
    again when the same models load anew; each later generation's diagnosis replays it exactly."""
    window = real_window
    window.method_actions["suffix"].trigger()
    window.max_tokens.setValue(24)
    generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    path = _export(window, tmp_path, "trace")
    first = window.session.generations[0]
    document = first.origin["prompt_ids"] + [t for e in first.events for t in e.emitted_ids]
    window.clear_session()
    assert window.open_trace(str(path)) and window.errors == []
    generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    assert window.session.generations[-1].suffix_replay[0] == [document]  # remembered from the trace
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    window.load_models(window.target_path, window.draft_path)  # a new decoder, a new memory
    qtbot.waitUntil(lambda: window.load_job is None, timeout=60000)
    generate(qtbot, window, prompt="def add(a, b):\n    return a + b\n")
    gen = window.session.generations[-1]
    assert len(gen.suffix_replay[0]) == 2 and gen.suffix_replay[0][0] == document
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=20000)
    assert {p.basis for p in window.diagnosis.diagnosis.report.predictions} == {"exact (replayed)"}
    from app.session import Session

    history = Session()  # the session read back (the next window's kept session): each memory rebuilt
    for kept in window.session.generations:
        history.add_run(kept.to_run(), "kept")
    rebuilt = [g.suffix_replay for g in history.generations]
    assert rebuilt == [g.suffix_replay for g in window.session.generations]
    assert history.generations[0].suffix_replay[0] == []  # the first began a session: nothing remembered


def test_real_decoder_method_switch_sampling_and_stop(qtbot, real_window):
    window = real_window
    window.method_actions["ngram"].trigger()
    window.apply_sampling({"decode/greedy": False, "decode/temperature": 1.0, "decode/seed": 3})
    window.max_tokens.setValue(40)
    generate(qtbot, window, prompt="abc abc abc abc")
    gen = window.session.generations[0]
    assert gen.events and all(e.method == "ngram" for e in gen.events)
    assert window.view.rendered_spans()[:-1] == expected_spans(gen.prompt, gen.events)
    window.method_actions["none"].trigger()
    window.max_tokens.setValue(200)
    generate(qtbot, window, prompt="x = 1", wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[1].events) >= 2, timeout=10000)
    window.stop()
    qtbot.waitUntil(lambda: not window.running, timeout=5000)
    stopped = window.session.generations[1]
    assert stopped.finish == "stopped" and stopped.tokens < 200
    assert window.errors == []


def test_check_lossless_proves_the_method_on_the_prompt(qtbot, real_window):
    """Method → Check lossless: greedy output equals plain greedy, and the sampled first two tokens pass the
    chi-squared test against the target's exact distribution (both on the tiny pair, off the GUI thread)."""
    window = real_window
    window.method_actions["draft"].trigger()
    window.max_tokens.setValue(24)
    window.prompt.setPlainText("def add(a, b):\n    return a + b\n")
    window.check_samples = 300
    window.check_action.trigger()
    assert window.running and not window.check_action.isEnabled() and not window.generate_button.isEnabled()
    qtbot.waitUntil(lambda: window.check_dialog is not None, timeout=120000)
    assert not window.running and window.errors == []
    dialog = window.check_dialog
    greedy, sampling = window.check_reports["greedy"], window.check_reports["sampling"]
    assert greedy.passed and greedy.tokens_compared == 24
    assert sampling.samples == 300 and sampling.passed
    assert dialog.passed and "greedy: PASS (24 generated" in dialog.text and "T=0.8" in dialog.text
    assert (window.progress.value(), window.progress.maximum()) == (300, 300)  # seeds done of N
    assert window.context_limit and window.max_tokens.maximum() == window.context_limit - 2


def test_check_lossless_shows_where_a_broken_method_diverges(qtbot, real_window, monkeypatch):
    """A decoder whose speculative output differs from plain decoding must fail, at the right position."""
    window = real_window
    decoder = window.decoder
    honest = decoder.generate_ids

    def broken(prompt, config, *args, **kwargs):
        ids = honest(prompt, config, *args, **kwargs)
        if config.method != "none" and len(ids) > 5:
            ids[5] = (ids[5] + 1) % decoder.vocab_size
        return ids

    monkeypatch.setattr(decoder, "generate_ids", broken)
    window.method_actions["draft"].trigger()
    window.max_tokens.setValue(12)
    window.prompt.setPlainText("x = 1\n")
    window.check_samples = 50
    window.check_action.trigger()
    qtbot.waitUntil(lambda: window.check_dialog is not None, timeout=120000)
    greedy = window.check_reports["greedy"]
    assert not greedy.passed and greedy.first_divergence == 5
    assert not window.check_dialog.passed and "greedy: FAIL first divergence at generated position 5" in \
        window.check_dialog.text


def test_check_lossless_stops_on_escape(qtbot, real_window):
    window = real_window
    window.method_actions["draft"].trigger()
    window.max_tokens.setValue(8)
    window.prompt.setPlainText("x = 1\n")
    window.check_samples = 10 ** 6
    window.check_action.trigger()
    qtbot.waitUntil(lambda: "greedy" in window.check_reports, timeout=60000)
    qtbot.keyClick(window.prompt, Qt.Key_Escape)
    qtbot.waitUntil(lambda: not window.running, timeout=20000)
    assert window.check_reports["sampling"] is None and not window.check_dialog.passed
    assert "sampling: stopped before the end" in window.check_dialog.text


# ------------------------------------------------------------------------------------------------------------
# The window as a daily tool: exports that reproduce a run, replay, comparison, views, shortcuts, validation


def _export(window, tmp_path, name):
    """Export the session's trace (JSONL) or metrics (CSV) to tmp_path/name given without its suffix."""
    answer_save(window, tmp_path / name)
    (window.export_jsonl if name.endswith("trace") else window.export_csv)()
    return tmp_path / (name + (".jsonl" if name.endswith("trace") else ".csv"))


def test_csv_has_settings_columns_running_columns_and_every_finish(qtbot, make_window, tmp_path):
    window = make_window(FakeDecoder(rounds=500, delay=0.01))
    window.apply_sampling({"decode/greedy": False, "decode/temperature": 0.7, "decode/top_k": 20,
                           "decode/top_p": 0.9, "decode/seed": 11})
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 3, timeout=5000)
    window.stop()
    qtbot.waitUntil(lambda: not window.running, timeout=5000)
    window.fake.rounds = 4
    window.method_actions["none"].trigger()
    generate(qtbot, window)
    path = _export(window, tmp_path, "metrics")  # the suffix is added
    rows = list(csv.DictReader(path.open()))
    header = rows[0].keys()
    for column in ("method", "k [tokens]", "temperature", "top_k", "top_p", "seed", "tree_nodes [nodes]",
                   "target", "draft", "device", "dtype", "running_acceptance_rate [ratio]",
                   "running_tokens_per_s [tokens/s]", "finish_reason"):
        assert column in header, column
    first = [r for r in rows if r["generation"] == "1"]
    plain = [r for r in rows if r["generation"] == "2"]
    assert first[0]["method"] == "draft" and first[0]["k [tokens]"] == "4" and first[0]["seed"] == "11"
    assert (first[0]["temperature"], first[0]["top_k"], first[0]["top_p"]) == ("0.7", "20", "0.9")
    assert first[0]["device"] == "FakeGPU 9000" and first[0]["target"] == "shipped"
    assert first[0]["round"] == "1"  # rounds count from 1, as in the window
    assert first[-1]["finish_reason"] == "stopped" and plain[-1]["finish_reason"] == "length"
    assert plain[0]["method"] == "none" and plain[0]["k [tokens]"] == ""  # plain decoding has no K
    assert window.errors == []


def test_jsonl_trace_has_a_header_per_generation(qtbot, make_window, tmp_path):
    import json

    window = make_window()
    generate(qtbot, window, prompt="x = <1>")
    window.method_actions["ngram"].trigger()
    generate(qtbot, window, prompt="y = 2")
    path = _export(window, tmp_path, "trace")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    headers = [r for r in records if r["type"] == "header"]
    assert [h["generation"] for h in headers] == [1, 2] and records[0]["type"] == "header"
    head = headers[0]
    assert head["format"] == "specplay-trace/1" and head["prompt"] == "x = <1>" and head["spec"] == "draft"
    assert head["settings"]["k"] == 4 and head["settings"]["sampling"]["temperature"] == 0.0
    assert set(head["models"]) == {"target", "draft"} and head["device"] == "FakeGPU 9000"
    assert {"specplay", "torch", "transformers"} <= set(head["versions"])
    assert headers[1]["spec"] == "ngram" and headers[1]["prompt"] == "y = 2"
    assert [h["prompt_ids"] for h in headers] == [[ord(c) for c in p] for p in ("x = <1>", "y = 2")]
    # the diagnosis of the last generation read its header: settings and the prompt's ids
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=5000)
    trace = window.diagnosis.diagnosis.report.trace
    assert trace.prompt_ids == [headers[1]["prompt_ids"]] and trace.settings["method"] == "ngram"
    rounds = [r for r in records if r["type"] == "round"]
    assert len(rounds) == 2 * window.fake.rounds and rounds[0]["generation"] == 1 and rounds[0]["round"] == 0


def test_the_diagnosis_follows_the_generation_shown(qtbot, make_window):
    window = make_window()
    generate(qtbot, window, prompt="x = 1")
    window.method_actions["ngram"].trigger()
    generate(qtbot, window, prompt="y = 2")
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=5000)  # made off the GUI thread
    assert window.diagnosis.diagnosis.report.trace.method == "ngram"  # the run that just ended
    window.history.setCurrentRow(0)  # an earlier run picked in the History
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=5000)
    assert window.diagnosis.diagnosis.report.trace.method == "draft"
    assert window.diagnosis.diagnosis.report.trace.prompt_ids == [[ord(c) for c in "x = 1"]]
    window.clear_session()
    assert window.diagnosis.diagnosis is None and window.errors == []


def test_only_the_latest_diagnosis_asked_for_is_shown(qtbot, make_window):
    window = make_window()
    generate(qtbot, window, prompt="x = 1")
    window.method_actions["ngram"].trigger()
    generate(qtbot, window, prompt="y = 2")
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=5000)
    window.history.setCurrentRow(0)
    assert window.diagnosis_slot.busy  # made off the GUI thread, delivered on a UI tick
    window.history.setCurrentRow(1)  # asked while the first runs: it waits, and the first is not shown
    assert window.diagnosing
    qtbot.waitUntil(lambda: not window.diagnosing, timeout=5000)
    assert window.diagnosis.diagnosis.report.trace.method == "ngram"  # row 1, the last asked for


def test_replay_of_a_saved_trace_reproduces_views_and_plots(qtbot, make_window, tmp_path):
    window = make_window()
    window.apply_sampling({"decode/greedy": False, "decode/temperature": 0.7, "decode/seed": 5})
    generate(qtbot, window)
    path = _export(window, tmp_path, "trace")
    live = window.session.generations[0]
    spans, buffers = window.view.rendered_spans(), live.buffers

    other = make_window(start=False)
    assert other.open_trace(str(path)) and other.errors == []
    replayed = other.session.generations[0]
    assert replayed.prompt == live.prompt and replayed.config == live.config
    assert other.view.rendered_spans() == spans  # every span, kind and round as it ran live
    for name in ("rounds", "round_alpha", "running_alpha", "round_tpf", "running_tpf", "analytic_tpf",
                 "per_position_tpf", "round_tpot", "running_tpot", "predicted_tpot"):  # the run's calibration
        assert getattr(replayed.buffers, name) == pytest.approx(getattr(buffers, name), nan_ok=True), name
    assert replayed.buffers.length_counts == buffers.length_counts
    other.plots.redraw()
    assert len(other.plots.curves["running_alpha"].getData()[0]) == len(live.events)
    assert "replayed" in other.history.item(0).text()
    assert other.tree_view.event.round == live.events[-1].round


def test_a_trace_of_other_models_is_predicted_from_its_own_times(qtbot, make_window, tmp_path):
    """A trace that carries no calibration of its own is priced with the loaded models' where it ran on
    them; one recorded on another target gets none (its own phase times), and a banner says so."""
    import json

    window = make_window()
    generate(qtbot, window)
    lines = _export(window, tmp_path, "trace").read_text().splitlines()
    header = json.loads(lines[0])
    header.pop("calibration", None)

    def saved(name: str, target: str):
        header["models"]["target"] = target
        path = tmp_path / name
        path.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")
        return str(path)

    assert window.calibration is not None
    assert window.open_trace(saved("same.jsonl", "shipped")) and window.errors == []
    assert window.session.generations[-1].calibration is window.calibration
    assert "other models" not in window.banner.label.text()
    assert window.open_trace(saved("moved.jsonl", "some-org/another-model")) and window.errors == []
    assert window.session.generations[-1].calibration is None
    assert "another-model" in window.banner.label.text() and "own phase times" in window.banner.label.text()


def test_opening_a_bad_trace_or_a_special_file_gives_a_dialog(qtbot, make_window, tmp_path):
    window = make_window()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert not window.open_trace(str(bad)) and "not JSON" in window.errors[-1][1]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert not window.open_trace(str(fifo)) and "not a regular file" in window.errors[-1][1]
    assert window.session.generations == []


def test_file_dialogs_never_read_special_files(qtbot, tmp_path):  # qtbot: icons need a QApplication
    """Qt's icon provider sniffs contents for the type column (typing /proc froze the GUI on /proc/kmsg)."""
    from PySide6.QtCore import QFileInfo
    from PySide6.QtWidgets import QFileDialog

    from app.widgets import SafeIconProvider, file_dialog

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block forever
    provider = SafeIconProvider()
    assert provider.type(QFileInfo(str(fifo))) == "Special file"
    provider.icon(QFileInfo(str(fifo)))  # returns at once
    dialog = file_dialog(None, "Open", QFileDialog.ExistingFile)
    qtbot.addWidget(dialog)  # closed and deleted while the QApplication lives
    assert isinstance(dialog.iconProvider(), SafeIconProvider)
    assert dialog.testOption(QFileDialog.DontUseNativeDialog)


def test_comparison_overlays_runs_and_tabulates_them_with_spread(qtbot, make_window):
    window = make_window()
    window.method_actions["none"].trigger()
    generate(qtbot, window)  # the plain reference
    window.method_actions["draft"].trigger()
    window.run_n_times(3)
    qtbot.waitUntil(lambda: len(window.session.generations) == 4 and not window.running, timeout=10000)
    assert [g.config.method for g in window.session.generations] == ["none"] + ["draft"] * 3
    window.compare_rows([0, 1, 2, 3])
    table = window.compare
    assert table.rowCount() == 2  # plain, and the three equal draft runs in one row
    draft_row = next(r for r in table.rows if r["method"] == "Draft model")
    assert draft_row["count"] == 3 and draft_row["tokens_per_s_sd"] is not None
    assert draft_row["speedup"] == pytest.approx(draft_row["tokens_per_s"] / table.rows[0]["tokens_per_s"])
    column = {name: COLUMNS.index(name) for name in ("K", "speedup", "tokens/s (mean ± sd)", "α")}
    assert "±" in table.item(1, column["tokens/s (mean ± sd)"]).text()
    assert table.item(0, column["K"]).text() == "—"  # plain: no K
    assert table.item(0, column["α"]).text() == "—" and table.item(1, column["speedup"]).text().endswith("×")
    window.plots.redraw()
    assert len(window.plots.overlays) == 3  # the shown run plus three overlaid
    tpot = [c for (key, _), c in window.plots.overlay_curves.items() if key == "tpot"]
    assert len(tpot) == 3 and all(len(c.getData()[0]) == window.fake.rounds for c in tpot)
    plain = window.session.generations[0].events[-1].metrics
    lines = window.plots.reference_lines  # the plain run's TPOT and tokens/s
    assert lines["tpot"].isVisible() and lines["tpot"].value() == pytest.approx(plain.tpot_ms)
    assert lines["tps"].isVisible() and lines["tps"].value() == pytest.approx(plain.tokens_per_s)


def test_clean_text_toggle_and_copy(qtbot, make_window):
    from PySide6.QtWidgets import QApplication

    window = make_window()
    generate(qtbot, window, prompt="say:")
    gen = window.session.generations[0]
    produced = "".join(i.text for e in gen.events for i in round_tokens(e) if i.kind in (ACCEPTED, CORRECTION,
                                                                                           BONUS))
    window.view.selectAll()
    assert window.view.selected_clean_text() == "say:" + produced  # no rejected drafts, no ↵ marks
    window.view.copy()
    assert QApplication.clipboard().text() == "say:" + produced
    qtbot.keyClick(window.view, Qt.Key_T, Qt.ControlModifier)
    assert window.clean_toggle.isChecked() and window.view.clean
    kinds = {k for k, _, _ in window.view.rendered_spans()}
    assert REJECTED not in kinds and UNTESTED not in kinds
    assert window.view.toPlainText().startswith("say:" + produced)
    assert window.view.generated_text() == produced
    window.view.selectAll()
    window.view.copy()
    assert QApplication.clipboard().text() == "say:" + produced
    window.clean_toggle.setChecked(False)
    assert REJECTED in {k for k, _, _ in window.view.rendered_spans()}


def test_tree_rounds_keep_the_accepted_path_inline_and_fold_the_branches(qtbot, make_window):
    from app.round_view import BRANCHES, describe

    window = make_window()
    event = tree_round()
    window.view.show_generation("p", [event])
    spans = [(k, t) for k, t, _ in window.view.rendered_spans()]
    assert spans[1:] == [(ACCEPTED, "t0"), (ACCEPTED, "t2"), (BRANCHES, "⋔3"), (CORRECTION, "Z")]
    marker = next(i for i in window.view.tokens if i.kind == BRANCHES)
    assert [b.text for b in marker.branches] == ["t1", "t3", "t4"] and "t3" in describe(marker)


def test_draft_tree_panel_has_numbers_legend_and_round_navigation(qtbot, make_window):
    window = make_window()
    window.apply_sampling({"decode/greedy": False, "decode/temperature": 0.7})
    generate(qtbot, window)
    panel = window.tree_panel
    # the last round of a finished run: followed, but no longer live (issue 52)
    assert panel.index == window.fake.rounds - 1 and "live" not in panel.position.text()
    panel.buttons["first"].click()
    assert panel.view.event.round == 0 and panel.position.text().startswith("round 1 of")
    panel.buttons["next"].click()
    assert panel.view.event.round == 1 and not panel.following
    node = panel.view.nodes[1]
    assert panel.view._numbers(node).startswith("p 0.50 q 0.25 u 0.10")
    assert "accepted path" in panel.legend.text()
    panel.buttons["last"].click()
    assert panel.following and panel.view.event.round == window.fake.rounds - 1


def test_escape_stops_with_the_focus_in_the_output_view(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=500, delay=0.01))
    generate(qtbot, window, wait=False)
    qtbot.waitUntil(lambda: len(window.session.generations[0].events) >= 3, timeout=5000)
    window.view.setFocus()
    qtbot.mouseClick(window.view.viewport(), Qt.LeftButton, pos=QPoint(5, 5))
    qtbot.keyClick(window.view, Qt.Key_Escape)
    qtbot.waitUntil(lambda: not window.running, timeout=2000)
    assert window.session.generations[0].finish == "stopped"


def test_window_wide_shortcuts_generate_and_pick_method_and_k(qtbot, make_window):
    window = make_window()
    window.prompt.setPlainText("def f(x):")
    window.history.setFocus()
    qtbot.keyClick(window.history, Qt.Key_3, Qt.ControlModifier)  # Ctrl+3: the third method (n-gram)
    qtbot.keyClick(window.history, Qt.Key_BracketRight, Qt.ControlModifier)  # Ctrl+]: K + 1
    qtbot.keyClick(window.history, Qt.Key_Return, Qt.ControlModifier)
    qtbot.waitUntil(lambda: not window.running and bool(window.session.generations), timeout=5000)
    assert (window.fake.configs[-1].method, window.fake.configs[-1].k) == ("ngram", 5)


class ContextDecoder(FakeDecoder):
    """A fake with a 64-token context and a tokenizer of one token a character."""

    class target:
        max_length = 64

    class tokenizer:
        @staticmethod
        def encode(text):
            return list(range(len(text)))


def test_max_new_tokens_is_limited_by_the_loaded_context(qtbot, make_window):
    window = make_window(ContextDecoder())
    assert window.context_limit == 64 and window.max_tokens.maximum() == 62
    window.max_tokens.setValue(60)  # fits the box, not with a 10-character prompt and K = 4
    generate(qtbot, window, prompt="0123456789")
    title, message = window.errors[-1]
    assert title == "Too long for the model" and "at most 48 new tokens" in message
    assert window.session.generations == [] and window.history.count() == 0  # no "error" entry
    window.max_tokens.setValue(48)
    generate(qtbot, window, prompt="0123456789")
    assert len(window.session.generations) == 1


def test_a_stopped_sweep_reports_what_it_measured_without_recommending(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=40, delay=0.01))
    window.prompt.setPlainText("def f(x):")
    window.sweep_action.trigger()
    qtbot.waitUntil(lambda: len(window.sweep_rows) >= 1, timeout=20000)
    assert window.progress.isVisible() and window.progress.maximum() == 6
    assert window.progress.value() == len(window.sweep_rows)  # Ks done of N
    window.view.setFocus()
    qtbot.keyClick(window.view, Qt.Key_Escape)
    qtbot.waitUntil(lambda: window.sweep_dialog is not None, timeout=20000)
    dialog = window.sweep_dialog
    assert not dialog.complete and dialog.use_button is None
    assert "recommends none" in dialog.summary.text() and "Fastest measured" not in dialog.summary.text()


def export_a_run_plots(qtbot, window, path):
    """Generate, then Session → Export plots to `path`; the window."""
    generate(qtbot, window)
    answer_save(window, path)
    window.export_plots()
    return window


def test_svg_export_is_plain_svg_that_a_non_qt_renderer_draws(qtbot, make_window, tmp_path):
    import shutil
    import subprocess
    import xml.etree.ElementTree as ET

    path = tmp_path / "plots.svg"
    export_a_run_plots(qtbot, make_window(), path)
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == ns + "svg" and root.get("viewBox") == "0 0 1260 520"
    texts = [t.text for t in root.iter(ns + "text")]
    assert "Acceptance rate α per round" in texts and "Time per output token" in texts
    assert "Tokens per second" in texts
    assert "running mean" in texts and "ms" in texts  # legends and units, no "(x0.001)"
    assert not any("x0.0" in (t or "") for t in texts)
    assert len(list(root.iter(ns + "polyline"))) >= 5 and len(list(root.iter(ns + "circle"))) > 20
    tags = {element.tag.removeprefix(ns) for element in root.iter()}
    assert tags <= {"svg", "title", "g", "rect", "text", "polyline", "circle", "line"}  # no clip paths
    converter = shutil.which("rsvg-convert")  # librsvg (apt-get install librsvg2-bin)
    if converter is None:
        pytest.skip("no non-Qt SVG renderer (librsvg's rsvg-convert) on this machine")
    png = tmp_path / "plots-from-svg.png"
    subprocess.run([converter, str(path), "-o", str(png)], check=True, timeout=60, capture_output=True)
    from PySide6.QtGui import QImage

    image = QImage(str(png))
    assert (image.width(), image.height()) == (1260, 520)
    colors = {image.pixelColor(x, y).name() for x in range(0, 1260, 7) for y in range(0, 520, 7)}
    assert len(colors) > 4  # curves and text drawn, not a blank or garbage page


def test_png_export_is_twice_the_screen_size(qtbot, make_window, tmp_path):
    from PySide6.QtGui import QImage

    path = tmp_path / "plots"
    window = export_a_run_plots(qtbot, make_window(), path)
    image = QImage(str(path) + ".png")
    size = window.plots.grid_page.size()
    assert (image.width(), image.height()) == (2 * size.width(), 2 * size.height())


def test_plots_have_no_multipliers_legends_outside_and_fitted_ranges(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=205))
    generate(qtbot, window)
    plots = window.plots
    plots.redraw()
    qtbot.wait(50)  # a legend whose column count changed is laid out on the next pass of the event loop
    for plot in (plots.alpha_plot, plots.tpf_plot, plots.tpot_plot):
        assert not plot.getAxis("left").autoSIPrefix and not plot.getAxis("bottom").autoSIPrefix
        assert not plot.legend.sceneBoundingRect().intersects(plot.vb.sceneBoundingRect())
        (x_low, x_high), _ = plot.vb.viewRange()
        assert x_high < 215 and x_low < 2  # 205 rounds on an axis to ~205, not 500
    assert plots.readout(plots.alpha_plot, 3).startswith("round 3:")


def test_tpot_outliers_are_clipped_and_marked(qtbot, make_window):
    window = make_window(FakeDecoder(rounds=50))
    generate(qtbot, window)
    gen = window.session.generations[0]
    gen.buffers.round_tpot[10] = 500.0  # one stalled round
    gen.buffers.version += 1
    window.plots.redraw()
    (_, _), (_, y_high) = window.plots.tpot_plot.vb.viewRange()
    assert y_high < 50
    assert len(window.plots.clipped["round_tpot"].getData()[0]) == 1


def test_small_window_collapses_plots_into_tabs(qtbot, make_window):
    window = make_window()
    window.resize(1000, 650)
    qtbot.waitUntil(lambda: window.plots.compact, timeout=2000)
    assert window.plots.tabs.count() == 7  # six plots and the summary
    window.resize(1500, 950)
    qtbot.waitUntil(lambda: not window.plots.compact, timeout=2000)


def test_help_explains_views_numbers_methods_and_shortcuts():
    from app.dialogs import HELP_HTML

    for topic in ("Round view", "Clean text", "Draft tree", "Compare", "greedy", "Medusa", "EAGLE", "EAGLE-3",
                  "Suffix decoding", "Layer skip", "Lookahead", "N-gram", "Esc", "Ctrl+Enter", "Ctrl+1",
                  "count from 1", "The session is kept", "Why is it slow?", "Find the fastest K",
                  "Find the fastest method", "Check lossless", "Model vs measurement"):
        assert topic in HELP_HTML, topic


def test_model_loading_shows_its_step_in_the_progress_bar(qtbot, make_window):
    release = threading.Event()

    def slow_loader(target, draft, device):
        release.wait(5)
        return FakeDecoder()

    window = make_window(loader=slow_loader, start=False)
    window.start()
    assert window.progress.isVisible() and window.progress.maximum() == 2 and window.progress.value() == 0
    assert "Loading the models (1 of 2)" in window.progress.format()
    release.set()
    qtbot.waitUntil(lambda: window.load_job is None, timeout=5000)
    assert not window.progress.isVisible() and window.decoder is not None


def test_untested_drafts_show_no_numbers():
    from app.round_view import describe

    info = TokenInfo(UNTESTED, 2, "x", depth=3, p=0.0, q=1.0, accept_prob=0.0, u=None, accepted=False,
                     tested=False)
    text = describe(info)
    assert "q(x)" not in text and "not tested" in text and "round 3, draft position 4" in text


def test_help_opens_beside_the_window(qtbot, make_window):
    window = make_window()
    qtbot.keyClick(window.view, Qt.Key_F1)
    assert window.help_dialog.isVisible() and not window.help_dialog.isModal()
    window.help_dialog.close()
