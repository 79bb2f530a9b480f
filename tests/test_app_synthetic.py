"""Issue 55 item 1 in the window: K → Synthetic acceptance for sweeps… (a mean length L or rates p1,p2,…) is
followed by Find the fastest K, the method sweep and the batch regime, whose results say SYNTHETIC; a bad
profile is a dialog; Check lossless refuses a profile in a dialog."""
from __future__ import annotations

import pytest
from app_windows import open_real_window
from test_app import generate, make_window  # noqa: F401 (a fixture)

from app.main_window import SWEEP_KS

pytestmark = pytest.mark.usefixtures("isolated_qsettings")


@pytest.fixture
def window(make_window):  # noqa: F811
    window = make_window()
    window.method_actions["draft"].trigger()
    window.prompt.setPlainText("def f(x):")
    window.max_tokens.setValue(12)
    return window


@pytest.mark.parametrize("text", ["0.9,abc", "1.2,0.5", "nan", "-", "0.5,,-0.1"])
def test_a_malformed_profile_is_a_dialog(window, text):
    assert not window.set_synthetic_acceptance(text)
    [(title, message)] = window.errors
    assert title == "Bad synthetic acceptance" and "Traceback" not in message
    assert window.synthetic_acceptance == ""


def test_the_k_sweep_follows_the_profile_on_the_ks_it_fits_and_says_synthetic(qtbot, window):
    assert window.set_synthetic_acceptance(" 2.5 ")
    assert window.synthetic_acceptance == "2.5" and "2.5" in window.synthetic_action.text()
    window.sweep_action.trigger()
    qtbot.waitUntil(lambda: window.sweep_dialog is not None, timeout=20000)
    assert window.errors == []
    measured = [k for k in SWEEP_KS if k >= 2]  # a length 2.5 needs K + 1 >= 2.5
    assert [row["k"] for row in window.sweep_rows] == measured
    drafted = [c for c in window.fake.configs if c.method == "draft"]
    assert drafted and all(c.synthetic_acceptance == "2.5" for c in drafted)
    assert all(c.synthetic_acceptance == "" for c in window.fake.configs if c.method == "none")
    assert all(row["synthetic_acceptance"] == "2.5" for row in window.sweep_rows)
    text = _dialog_text(window.sweep_dialog)
    assert "SYNTHETIC acceptance" in text and "mean acceptance length 2.5" in text
    assert "K = 1 left out" in text


def _synthetic_result(qtbot, window, action, dialog: str, timeout: int) -> str:
    """Trigger a sweep, wait for its result dialog and the end of the job: no error, the dialog says the
    figures follow a synthetic profile. Returns the dialog's text."""
    action.trigger()
    qtbot.waitUntil(lambda: getattr(window, dialog) is not None, timeout=timeout)
    qtbot.waitUntil(lambda: not window.running, timeout=10000)
    assert window.errors == []
    text = _dialog_text(getattr(window, dialog))
    assert "SYNTHETIC acceptance" in text
    return text


def _dialog_text(dialog) -> str:
    from PySide6.QtWidgets import QLabel

    return " ".join(label.text() for label in dialog.findChildren(QLabel))


def test_a_profile_no_k_fits_is_a_dialog(window):
    window.set_synthetic_acceptance(",".join(["0.9"] * 9))  # 9 rates: more than the largest K swept
    window.sweep_action.trigger()
    assert not window.running and window.sweep_dialog is None
    [(title, message)] = window.errors
    assert title == "Bad synthetic acceptance" and "at most K rates" in message


def test_the_method_sweep_follows_the_profile_and_says_synthetic(qtbot, window):
    window.k_actions[4].trigger()
    window.set_synthetic_acceptance("0.9,0.5")
    text = _synthetic_result(qtbot, window, window.method_sweep_action, "method_dialog", 20000)
    assert "per-position rates 0.9,0.5" in text
    drafted = [c for c in window.fake.configs if c.method != "none"]
    assert drafted and all(c.synthetic_acceptance == "0.9,0.5" for c in drafted)


def test_a_profile_longer_than_k_stops_the_method_sweep_in_a_dialog(window):
    window.k_actions[2].trigger()
    window.set_synthetic_acceptance("0.9,0.8,0.7")
    window.method_sweep_action.trigger()
    assert not window.running and window.method_dialog is None
    [(title, message)] = window.errors
    assert title == "Bad synthetic acceptance" and "3 rates for K = 2" in message


def test_check_lossless_refuses_a_profile_in_a_dialog(window):
    window.set_synthetic_acceptance("3")
    window.check_action.trigger()
    assert not window.running and window.check_dialog is None
    [(title, message)] = window.errors
    assert title == "Check lossless refused" and "synthetic acceptance" in message
    window.errors.clear()
    window.set_synthetic_acceptance("")  # cleared: the check runs again
    assert window.synthetic_acceptance == "" and "(" not in window.synthetic_action.text()


def test_a_generation_never_follows_the_sweeps_profile(qtbot, window):
    window.set_synthetic_acceptance("2")
    generate(qtbot, window)
    assert window.fake.configs[-1].synthetic_acceptance == ""


def test_the_batch_regime_follows_the_profile_and_says_synthetic(qtbot, tiny_pair_dirs, monkeypatch):
    from engine.bench import batch

    configs, real = [], batch.bench_batch

    def spy(decoder, prompts, config, *args, **kwargs):
        configs.append(config)
        return real(decoder, prompts, config, *args, **kwargs)

    monkeypatch.setattr(batch, "bench_batch", spy)
    window = open_real_window(qtbot, *tiny_pair_dirs)
    window.method_actions["draft"].trigger()
    window.k_actions[2].trigger()
    window.prompt.setPlainText("the cat sat on the mat. the cat")
    window.batch_sizes, window.batch_new_tokens = (1, 2), 6
    window.set_synthetic_acceptance("2")
    _synthetic_result(qtbot, window, window.batch_action, "batch_dialog", 60000)
    assert [c.synthetic_acceptance for c in configs] == ["2"]
