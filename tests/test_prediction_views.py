"""The predict / diagnose commands and the GUI pieces that show predictions: the summary panel, the sweep
dialog's "predicted from this run" column and the diagnosis dock."""
import json

import pytest
from trace_fixtures import chain_round, write_trace

from engine.analysis.costmodel import CostModel, Measured
from engine.cli.main import main


def bursty(rounds=30, k=8):
    return [chain_round(i, k, k if i % 3 == 0 else 1, draft_ms=0.2 * k, verify_ms=2.2, overhead_ms=0.1)
            for i in range(rounds)]


def costs() -> CostModel:
    return CostModel(verify={1: Measured(2.0, 0.1), 9: Measured(2.2)},
                     draft_step={"draft": Measured(0.2, 0.02)},
                     overhead={"none": Measured(0.1), "draft": Measured(0.1)})


def test_predict_and_diagnose_commands(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", bursty(), header={"config": {"sampling": {"temperature": 0}}})
    assert main(["predict", "--trace", trace, "--no-calibrate", "--ks", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "predicted best K" in out and "alpha_d (95% CI)" in out and "exact" in out
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps(costs().to_dict()))
    assert main(["predict", "--trace", trace, "--costs", str(cost_file), "--json", "--ks", "1,8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["k"] for p in report["predictions"]] == [1, 8] and report["exact"]
    assert main(["diagnose", "--trace", trace, "--costs", str(cost_file)]) == 0
    assert "plain round" in capsys.readouterr().out
    assert main(["predict", "--trace", str(tmp_path / "missing.jsonl"), "--no-calibrate"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_predict_calibrates_on_the_models(tmp_path, capsys, tiny_pair_dirs):
    from engine.config import GenerationConfig
    from engine.core.decoder import SpeculativeDecoder
    from engine.core.metrics import write_jsonl
    from engine.models.loading import load_pair

    target, draft = map(str, tiny_pair_dirs)
    decoder = SpeculativeDecoder(load_pair(target, draft, device="cpu"))
    events = list(decoder.generate("the cat sat", GenerationConfig(method="draft", k=4, max_new_tokens=24)))
    trace = tmp_path / "t.jsonl"
    write_jsonl(events, trace)
    saved = tmp_path / "costs.json"
    assert main(["predict", "--trace", str(trace), "--target", target, "--draft", draft, "--device", "cpu",
                 "--save-costs", str(saved), "--ks", "2,4"]) == 0
    assert "calibration + run" in capsys.readouterr().out
    assert 9 in CostModel.from_dict(json.loads(saved.read_text())).verify


class CostCalibration:
    """A Calibration with a cost model, as decoder.calibrate returns it."""

    def __init__(self):
        from engine.core.decoder import Calibration

        self.inner = Calibration(target_step_ms=2.1, draft_step_ms=0.2, costs=costs())

    def __getattr__(self, name):
        return getattr(self.inner, name)


def real_events(n=12, k=4):
    """RoundEvents (objects, not dicts) with running metrics from the engine's accumulator."""
    from engine.core.metrics import MetricsAccumulator
    from engine.events import DraftedToken, RoundEvent

    acc, events = MetricsAccumulator(k), []
    for i in range(n):
        accepted = k if i % 2 else 1
        drafted = [DraftedToken(token_id=d, text="x", parent=d - 1, depth=d, p=0.9, q=1.0, accept_prob=1.0,
                                u=None, accepted=d < accepted, tested=d <= accepted, top=[("x", 0.9)])
                   for d in range(k)]
        metrics = acc.add_round(k, accepted, accepted + 1, k, 0.8, 2.1, 0.1)
        events.append(RoundEvent(round=i, method="draft", k=k, drafted=drafted, accepted_count=accepted,
                                 next_token_id=7, next_token_text="y", next_is_bonus=accepted == k,
                                 next_token_p=0.9, next_top=[("y", 0.9)],
                                 emitted_ids=list(range(accepted + 1)),
                                 emitted_text="", position=0, draft_ms=0.8, verify_ms=2.1, overhead_ms=0.1,
                                 finished=i == n - 1, finish_reason="length" if i == n - 1 else None,
                                 metrics=metrics))
    return events


def test_plot_buffers_predict_with_the_cost_model_and_keep_the_textbook_line():
    from app.plot_data import PlotBuffers, summary_html

    buffers = PlotBuffers(CostCalibration())
    for event in real_events():
        buffers.add(event)
    m = buffers.last_event.metrics
    costs = buffers.costs
    assert costs.source == "calibration + run"
    expected = costs.t_round("draft", 4, 5) / m.per_position_tokens_per_forward
    assert buffers.predicted_tpot[-1] == pytest.approx(expected)
    c = costs_c = CostCalibration().c_for("draft")
    assert buffers.textbook_tpot[-1] == pytest.approx(2.1 * (1 + c * 4) / m.analytic_tokens_per_forward)
    assert costs_c > 0
    text = summary_html(buffers)
    assert "per-depth" in text and "chapter's uniform-α" in text and "95% CI" in text
    assert "measured costs" in text and "±" in text and "constant-α law" in text


def test_sweep_dialog_shows_predictions_from_this_run(qtbot):
    from app.dialogs import SweepDialog

    rows = [{"k": k, "alpha": 0.7, "tokens_per_forward": 1.5 + k / 4, "tokens_per_s": 100.0 * k,
             "speedup": 0.8 + k / 10, "predicted_speedup": 0.9, "textbook_speedup": 1.0,
             "from_run_speedup": 1.0 + k / 10, "from_run_tokens_per_forward": 1.4 + k / 4,
             "from_run_basis": "exact", "from_run_k": 4} for k in (4, 1, 2)]
    dialog = SweepDialog(None, rows, "Draft model")
    qtbot.addWidget(dialog)
    headers = [dialog.table.horizontalHeaderItem(i).text() for i in range(dialog.table.columnCount())]
    assert "predicted\nfrom this run" in headers and "textbook\nE/(1+cK)" in headers
    assert dialog.width() >= dialog.table.horizontalHeader().length() + 40  # every column in sight
    assert dialog.table.item(0, 0).text() == "1"  # sorted by K
    assert dialog.best == 4
    stopped = SweepDialog(None, [{k: v for k, v in rows[0].items() if not k.startswith("from_run")}], "x")
    qtbot.addWidget(stopped)
    assert "predicted\nfrom this run" not in [stopped.table.horizontalHeaderItem(i).text()
                                             for i in range(stopped.table.columnCount())]


def test_diagnosis_view_names_each_findings_figure(qtbot):
    from app.diagnosis_view import DiagnosisView

    view = DiagnosisView()
    qtbot.addWidget(view)
    view.show_generation(real_events(), CostCalibration())
    assert view.diagnosis is not None
    text = view.toPlainText()
    assert "plain round" in text and "Predicted best K" in text
    for finding in view.diagnosis.findings:
        assert "figure:" in text and finding.title in text


def test_sweep_dialog_flags_a_machine_whose_speed_moved(qtbot):
    """A sweep whose plain runs drifted more than 10% says so under its verdict; a steady one does not."""
    from app.dialogs import SweepDialog

    def rows(plain):
        return [{"k": k, "alpha": 0.7, "tokens_per_forward": 2.0, "tokens_per_s": 100.0 * k,
                 "speedup": 1.0 + k, "predicted_speedup": 1.0, "textbook_speedup": 1.0,
                 "plain_tokens_per_s": p, "calibrated_plain_ms": 1000 / 3000} for k, p in zip((1, 2), plain)]

    drifted = SweepDialog(None, rows([3000, 2000]), "Draft model")
    qtbot.addWidget(drifted)
    assert "speed moved during the sweep" in drifted.summary.text()
    steady = SweepDialog(None, rows([3000, 3050]), "Draft model")
    qtbot.addWidget(steady)
    assert "speed moved" not in steady.summary.text()
