"""The head doctor (engine/analysis/doctor.py): the conventions it tries, the findings it draws from measured
acceptance, a run over a published EAGLE-3 head, and the CLI on the shipped pair."""
from __future__ import annotations

import pytest
import torch
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


def _permutation_target(folder, vocab: int, hidden: int, layers: int) -> tuple:
    """A tiny Llama whose next token is a fixed permutation of the current one (EOS only after EOS): its
    attention adds nothing (o_proj zero), so a position's residual stream before layer k is a function of its
    own token, h_k(x), and MLPs that each outweigh the stream before them make each layer's differ. Returns
    (folder, perm, h) with h[k] [V, H] the streams (transformers' hidden_states[k]) of every token."""
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_llama
    from transformers import AutoModelForCausalLM

    make_tiny_llama(folder, vocab=vocab, hidden=hidden, layers=layers, seed=7, std=0.15)
    weights = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
        elif name.endswith("down_proj.weight"):  # each layer's MLP outweighs the stream it reads
            layer = int(name.split(".")[2])
            weights[name] = 1.5 * 8.0 ** layer * torch.randn(weights[name].shape, generator=gen)
    perm = torch.randperm(vocab - 3, generator=gen) + 3  # ids 0..2 are special: never reached
    perm = torch.cat([torch.arange(3), perm])
    save_file(weights, str(folder / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        # [V, 1, H] each
        states = model(torch.arange(vocab)[:, None], output_hidden_states=True).hidden_states
    h = [s[:, 0] for s in states]
    weights["lm_head.weight"] = torch.zeros(vocab, hidden)
    weights["lm_head.weight"][perm] = h[layers]  # row perm[x] scores the final-normed stream of x highest
    save_file(weights, str(folder / "model.safetensors"))
    return folder, perm, h


def test_the_doctor_names_the_convention_a_head_was_built_for(tmp_path):
    """An EAGLE-3 head built to read taps (2, 3, 4) exactly (its fc keeps the first tap, its layer adds
    nothing, its LM head maps each token's tapped stream to the token two steps on): its first draft is right
    for every token under those taps. Its config says (1, 2, 3), one layer early: the doctor finds that one
    layer later accepts most and names it."""
    from safetensors.torch import load_file, save_file

    from engine.core.decoder import SpeculativeDecoder
    from engine.models.loading import load_pair

    vocab, hidden, layers = 40, 32, 6
    target, perm, h = _permutation_target(tmp_path / "target", vocab, hidden, layers)
    folder = make_eagle3(tmp_path / "heads", draft_vocab=vocab, taps=(1, 2, 3))
    t = load_file(str(folder / "model.safetensors"))
    t = {name: torch.zeros_like(v) if name.startswith("midlayer.") else v for name, v in t.items()}
    for name in ("norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight"):
        t[name] = torch.ones(hidden)
    t["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1)  # g = h_2
    tapped = h[2] / h[2].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # the head's final RMSNorm of g
    t["lm_head.weight"] = torch.zeros(vocab, hidden)
    t["lm_head.weight"][perm[perm]] = tapped
    t["d2t"] = torch.zeros(vocab, dtype=torch.long)
    t["t2d"] = torch.ones(vocab, dtype=torch.bool)
    save_file(t, str(folder / "model.safetensors"))

    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    decoder.use_heads(str(folder))
    report = doctor.diagnose_heads(decoder, "eagle3", ["abc", "hello"], k=2, max_new_tokens=16)
    later = [r for r in report.results if r.taps == (2, 3, 4)]
    assert later and all(r.acceptance.alphas[0] >= 0.8 for r in later)  # built for them: nearly always right
    assert report.as_written.acceptance.alphas[0] < 0.5
    assert report.best.taps == (2, 3, 4)
    assert any("one layer later" in f and "evidently trained" in f for f in report.findings)
