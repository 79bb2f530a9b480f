"""A reduced draft vocabulary (engine/train/draft_vocab.py) and a published EAGLE-3 head in the target's own
folder (its eagle3/ subfolder), as the shipped family has it."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_public_heads import PROMPT, VOCAB, make_eagle3, target_dir  # noqa: F401 (a fixture)

from engine.analysis.lossless import check_greedy
from engine.config import GenerationConfig
from engine.core.decoder import SpeculativeDecoder
from engine.methods import registry
from engine.methods.eagle3.drafter import own_published_head
from engine.methods.eagle3.public import PublicEagle3Head
from engine.models.loading import load_pair
from engine.train import draft_vocab


def test_choose_ids_keeps_the_most_frequent_and_the_special_tokens():
    counts = np.array([0, 0, 5, 9, 1, 7, 3, 0])
    ids = draft_vocab.choose_ids(counts, 4, always=(0,))
    assert ids.tolist() == [0, 2, 3, 5]  # 0 always, then 9, 7, 5 by count; ascending
    with pytest.raises(ValueError):
        draft_vocab.choose_ids(counts, 9)


def test_reduced_head_drafts_the_full_heads_logits_on_the_kept_tokens(target_dir, tmp_path):  # noqa: F811
    """The cut head's logits equal the full head's at every kept token and are -inf elsewhere; d2t maps
    each draft id to its target id and t2d marks them."""
    full = make_eagle3(tmp_path / "full", "speculators", draft_vocab=VOCAB)
    cfg_vocab = VOCAB
    keep = torch.tensor(sorted(torch.randperm(cfg_vocab, generator=torch.Generator().manual_seed(3))[:20]
                               .tolist()))
    draft_vocab.reduce_head(full, tmp_path / "cut", keep, coverage=0.5)
    state = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert state["lm_head.weight"].shape[0] == 20
    assert (torch.arange(20) + state["d2t"]).tolist() == keep.tolist()
    assert state["t2d"].nonzero().flatten().tolist() == keep.tolist()
    pair = load_pair(str(target_dir), None, device="cpu", need_draft=False)
    from engine.methods import public_heads

    heads = [PublicEagle3Head.load(public_heads.detect(str(d)), pair.target)
             for d in (full, tmp_path / "cut")]
    h = torch.randn(3, heads[0].lm_head.shape[1], generator=torch.Generator().manual_seed(4))
    full_logits, cut_logits = (head.logits(h.to(pair.target.dtype)) for head in heads)  # [3, V] each
    assert torch.equal(cut_logits[:, keep], full_logits[:, keep])
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    assert torch.isinf(cut_logits[:, off]).all()


def test_a_published_head_in_the_targets_folder_is_its_own(target_dir, tmp_path):  # noqa: F811
    """eagle3/ in the target's folder makes EAGLE-3 available and is what the decoder drafts with (greedy
    output equal to plain decoding); the project's own files, where present, win."""
    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    method = registry.get("eagle3")
    reason = registry.unavailable_reason(method, False, True, str(target))
    assert reason is not None and "eagle3/config.json" in reason
    make_eagle3(target / "eagle3", "speculators", draft_vocab=24)
    assert own_published_head(target) == target / "eagle3"
    assert registry.unavailable_reason(method, False, True, str(target)) is None
    decoder = SpeculativeDecoder(load_pair(str(target), None, device="cpu", need_draft=False))
    assert isinstance(decoder.eagle3_head(), PublicEagle3Head)
    report = check_greedy(decoder, PROMPT, GenerationConfig(method="eagle3", k=3, max_new_tokens=24,
                                                            stop_at_eos=False))
    assert report.passed, report
    from engine.analysis.doctor import diagnose_heads

    doctor = diagnose_heads(decoder, "eagle3", [PROMPT], k=3, max_new_tokens=8)
    assert doctor.description.startswith(f"the target's own eagle3 heads in {target / 'eagle3'}")
    assert "layout: EAGLE-3 (speculators)" in doctor.description and "heads: heads" not in doctor.format()
    (target / "eagle3_head.safetensors").write_bytes(b"")  # the project's own head named: it wins
    assert own_published_head(target) is None


@pytest.mark.parametrize("damage", ["config not JSON", "weights truncated"])
def test_a_broken_head_in_the_targets_folder_is_one_line(target_dir, tmp_path, capsys, damage):  # noqa: F811
    """run --method eagle3 on a target whose eagle3/ head is damaged: status 2, one line naming the file."""
    from engine.cli.main import main

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    make_eagle3(target / "eagle3", "speculators", draft_vocab=24)
    if damage == "config not JSON":
        (target / "eagle3" / "config.json").write_text("{oops")
    else:
        weights = target / "eagle3" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:200])
    code = main(["run", "--target", str(target), "--method", "eagle3", "--prompt", "def f(x):",
                 "--max-new-tokens", "4", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "eagle3" in err[0], err
