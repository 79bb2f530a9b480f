"""The head doctor (engine/analysis/doctor.py): the conventions it tries, the findings it draws from measured
acceptance, a run over a published EAGLE-3 head, and the CLI on the shipped pair."""
from __future__ import annotations

import pytest
from test_public_heads import LAYERS, decoder_with, make_eagle3, target_dir  # noqa: F401 (a fixture)

from engine.analysis import doctor
from engine.analysis.acceptance import DepthAcceptance
from engine.cli.main import main


def _result(label, per_forward, reached=(10, 8), accepted=(8, 6)):
    acceptance = DepthAcceptance(list(reached), list(accepted))
    return doctor.ConventionResult(label, (), False, acceptance, per_forward)


def test_a_convention_that_accepts_clearly_more_is_named():
    results = [_result("as written", 1.4), _result("one later", 2.9)]
    report = doctor.DoctorReport("eagle3", "heads", 4, results)
    assert report.best.label == "one later"
    found = doctor.findings(report)
    assert any("one later" in f and "evidently trained" in f for f in found)


def test_the_configured_convention_is_kept_on_a_near_tie():
    report = doctor.DoctorReport("eagle3", "heads", 4, [_result("as written", 2.00), _result("other", 2.05)])
    assert any("no convention mismatch" in f for f in doctor.findings(report))


def test_low_first_position_and_poor_coverage_are_findings():
    report = doctor.DoctorReport("eagle3", "heads", 4, [_result("as written", 1.1, accepted=(1, 0))],
                                 coverage=0.7)
    found = " ".join(doctor.findings(report))
    assert "first draft position is accepted 10%" in found and "30% of the tokens lie outside" in found


class _Head:
    taps_as_written = (2, 4, 6)
    before_residual = False

    def set_convention(self, taps, before):
        self.taps_as_written, self.before_residual = taps, before


@pytest.mark.parametrize("layers, shifts", [(8, {0, -1, 1}), (7, {0, -1})])
def test_conventions_cover_each_tap_shift_and_norm_option_that_fits(layers, shifts):
    options = doctor.conventions(_Head(), layers)
    found = {(taps[0] - 2, before) for _, taps, before in options}
    assert found == {(s, b) for s in shifts for b in (False, True)}
    assert options[0][1] == (2, 4, 6) and "[config]" in options[0][0]  # as written first


def test_other_heads_run_as_loaded():
    assert doctor.conventions(object(), 8) == [("as loaded", (), False)]


def test_a_published_eagle3_head_under_every_convention(target_dir, tmp_path):  # noqa: F811
    folder = make_eagle3(tmp_path / "heads", "speculators", taps=(1, 2, 3), draft_vocab=24)
    decoder = decoder_with(target_dir, folder)
    head = decoder.eagle3_head()
    report = doctor.diagnose_heads(decoder, "eagle3", ["the cat sat", "a b a b"], k=2, max_new_tokens=8)
    shifts = {r.taps[0] - 1 for r in report.results}
    assert shifts == {s for s in (0, -1, 1) if 1 <= 1 + s and 3 + s < LAYERS}
    assert len(report.results) == 2 * len(shifts)
    assert all(r.acceptance.reached[0] > 0 for r in report.results)  # every convention ran rounds
    assert head.taps_as_written == (1, 2, 3)  # left as loaded
    assert report.coverage is not None and 0.0 <= report.coverage <= 1.0  # a reduced draft vocabulary
    assert head.target_ids.numel() == 24


def test_doctor_on_the_shipped_eagle3_head(capsys):
    assert main(["doctor", "--method", "eagle3", "--prompts", "1", "--max-new-tokens", "12", "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "the target's own eagle3 heads" in out and "α by position" in out and "tokens/forward" in out


def test_doctor_refuses_bad_sizes_in_one_line(capsys):
    assert main(["doctor", "--k", "0"]) == 2
    assert "doctor takes --k" in capsys.readouterr().err
