"""Issue 52 leftovers: the inspector names the distribution of p(x) and of the top-alternatives list (a
drafted token's p(x) is the sampling distribution, top-k and top-p applied; the list and a correction's p(x)
are the softmax before them), and the exported SVG names the TPOT plot's predictions as the screen does."""
from __future__ import annotations

import re

import pytest
from test_app import generate, make_window  # noqa: F401 (a fixture)

from app import svg_export
from app.plot_data import PREDICTED_TPOT_LABEL, TEXTBOOK_TPOT_LABEL
from app.round_view import ACCEPTED, CORRECTION, TOP_LABEL, TokenInfo, describe
from app.style import LIGHT

pytestmark = pytest.mark.usefixtures("isolated_qsettings")

TOP = [("a", 0.5), ("b", 0.3)]


def test_a_sampled_drafts_p_and_the_list_name_their_distributions():
    info = TokenInfo(ACCEPTED, 0, "a", depth=0, output_pos=0, p=0.625, q=0.4, accept_prob=1.0, u=0.2,
                     accepted=True, tested=True, top=TOP)
    text = describe(info)
    assert "p(x) = 0.6250 under the target's sampling distribution (T, top-k, top-p applied)" in text
    assert TOP_LABEL in text and "renormalised over the tokens they keep" in text


def test_a_greedy_drafts_p_is_the_lists_t1_softmax():
    info = TokenInfo(ACCEPTED, 0, "a", depth=0, output_pos=0, p=0.5, q=1.0, accept_prob=1.0, u=None,
                     accepted=True, tested=True, top=TOP)
    text = describe(info)
    assert "T = 1 probability, as in the list below" in text and TOP_LABEL in text


def test_a_corrections_p_is_the_same_softmax_as_its_list():
    info = TokenInfo(CORRECTION, 0, "a", output_pos=1, p=0.5, top=TOP)
    text = describe(info)
    assert "p(x) = 0.5000, the softmax of the target's logits at the sampling T" in text
    assert "as the list below" in text and "0.500" in text.split(TOP_LABEL)[1]


def test_the_svg_names_the_tpot_predictions_as_the_screen(qtbot, make_window):  # noqa: F811
    window = make_window()
    generate(qtbot, window)
    legend = {sample.item: label.text for sample, label in window.plots.tpot_plot.legend.items}
    curves = window.plots.curves
    assert legend[curves["predicted_tpot"]] == PREDICTED_TPOT_LABEL
    assert legend[curves["textbook_tpot"]] == TEXTBOOK_TPOT_LABEL
    svg = svg_export.plots_svg(window.plots.buffers, LIGHT)
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert PREDICTED_TPOT_LABEL in texts and TEXTBOOK_TPOT_LABEL in texts
    tpot = next(p for p in svg_export.panels(window.plots.buffers, LIGHT) if p[0] == "Time per output token")
    series = {name: points for name, _, _, points in tpot[3]}
    assert series[PREDICTED_TPOT_LABEL] and series[TEXTBOOK_TPOT_LABEL]  # both curves drawn, as on screen
