"""EAGLE-3: the runner's layer taps, the training-time-test head against the engine's drafting, a training
step."""
from __future__ import annotations

import torch

from engine.methods.eagle3.drafter import Eagle3Head as EngineHead
from engine.models.llama import LlamaRunner
from engine.train import eagle3, lm
from engine.train.presets import ModelShape


def tiny_target(tmp_path, layers: int = 3):
    lm.seed_all(0)
    model = lm.build_lm(ModelShape(hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=2,
                                   intermediate_size=128), vocab_size=96, seq_len=64).eval()
    for p in model.parameters():   # spread the weights so that the layers differ clearly
        p.data.normal_(0, 0.08) if p.ndim > 1 else p.data.uniform_(0.8, 1.2)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    return model


def test_runner_taps_are_the_layer_outputs(tmp_path):
    model = tiny_target(tmp_path)
    runner = LlamaRunner.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([0, 5, 17, 42, 7, 9, 11])
    assert runner.forward(ids).taps is None                      # no tap layers: nothing collected
    runner.reset()
    runner.tap_layers = (0, 2)
    out = runner.forward(ids)
    taps, logits = eagle3.tapped_forward(model, ids[None], (0, 2))
    assert out.taps.shape == (7, 128)
    assert torch.allclose(out.taps, taps[0], atol=1e-4)
    assert torch.allclose(out.taps[:, 64:], out.hidden, atol=1e-5)   # the last layer is the usual feature
    assert torch.allclose(out.logits, logits[0], atol=1e-4)


def _check_drafter_steps(engine_head, true: torch.Tensor, ids: torch.Tensor, outs: list) -> torch.Tensor:
    """The drafter's steps through the engine's runner equal the training-time test's rows (outs, steps 1..3):
    step 1 on all true rows, then a chain from row 6 on the head's own outputs. Returns step 1's [11, H]."""
    h1 = engine_head.step(engine_head.true_features(true[:11]), ids[1:12])  # all true rows
    assert torch.allclose(h1, outs[0][0], atol=1e-4)
    c = 6  # a chain from row 6
    engine_head.runner.reset()
    last = engine_head.step(engine_head.true_features(true[:c + 1]), ids[1:c + 2])[-1:]
    h2 = engine_head.runner.forward_embeds(engine_head.fuse(last, ids[c + 2:c + 3])).hidden
    assert torch.allclose(h2[0], outs[1][0, c + 1], atol=1e-4)
    h3 = engine_head.runner.forward_embeds(engine_head.fuse(h2, ids[c + 3:c + 4])).hidden
    assert torch.allclose(h3[0], outs[2][0, c + 2], atol=1e-4)
    return h1


def test_training_time_test_is_what_the_drafter_computes(tmp_path):
    """Step 1 of the head on the true features, then steps 2 and 3 on its own outputs, through the engine's
    runner (as the eagle3 drafter does), equal the training-time test's rows of the chain."""
    model = tiny_target(tmp_path)
    taps_layers = eagle3.default_taps(3)
    assert taps_layers == (0, 1, 2)
    head = eagle3.Eagle3Head.for_target(model.config, taps_layers, inter=96).eval()
    eagle3.save_eagle3(head, tmp_path, dtype=torch.float32)
    runner = LlamaRunner.from_pretrained(tmp_path, dtype=torch.float32)
    runner.tap_layers = taps_layers
    engine_head = EngineHead.load(tmp_path, runner)
    assert engine_head.tap_layers == taps_layers

    ids = torch.tensor([0, 5, 17, 42, 7, 9, 11, 3, 30, 60, 21, 8])
    taps, _ = eagle3.tapped_forward(model, ids[None], taps_layers)            # [1, 12, 3H]
    with torch.no_grad():
        outs = head.ttt(taps[:, :11], model.model.embed_tokens(ids[None, 1:12]), steps=3)
        true = runner.forward(ids).taps                                         # [12, 3H]
        _check_drafter_steps(engine_head, true, ids, outs)


def test_ttt_mask_sees_true_rows_and_its_own_chain():
    mask = eagle3.ttt_mask(5, 2, "cpu")   # step 3 (0-based 2): 3 blocks of 5 keys
    row = 4
    assert mask[row, :5].tolist() == [True, True, True, False, False]            # true rows <= 4 - 2
    assert mask[row, 5:10].tolist() == [False, False, False, True, False]        # step 2's row 3
    assert mask[row, 10:].tolist() == [False, False, False, False, True]         # itself


def test_eagle3_training_step_lowers_the_loss(tmp_path):
    model = tiny_target(tmp_path, layers=2)
    for p in model.parameters():
        p.requires_grad_(False)
    head = eagle3.Eagle3Head.for_target(model.config, eagle3.default_taps(2), inter=96).train()
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(3, 96, (4, 33), generator=gen)
    w[:, 16:] = w[:, :17]                       # a repeat, so that there is something to learn
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    before = eagle3.eval_eagle3(head.eval(), model, w, torch.device("cpu"), steps=3, decay=0.8)
    head.train()
    for _ in range(25):
        loss = eagle3.eagle3_loss(head, model, w, steps=3, decay=0.8)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = eagle3.eval_eagle3(head.eval(), model, w, torch.device("cpu"), steps=3, decay=0.8)
    assert after["eagle3_loss"] < before["eagle3_loss"] - 0.1
    assert all(0.0 <= after[f"chain{s}_top1"] <= after[f"step{s}_top1"] + 1e-9 for s in (1, 2, 3))
    assert after["chain3_top1"] <= after["chain2_top1"] <= after["chain1_top1"]
    assert all(p.grad is None for p in model.parameters())   # the target stays frozen


def test_published_head_training_time_test_is_what_the_public_loader_computes(tmp_path):
    """The published-architecture variant (speculators layout): trained a few steps on the CPU (its loss
    falls), saved, loaded by the engine's public loader; step 1 on the true taps and steps 2-3 on its own
    outputs equal the training-time test's rows of the chain."""
    from engine.methods import public_heads
    from engine.methods.eagle3.public import PublicEagle3Head

    model = tiny_target(tmp_path / "target", layers=5)
    for p in model.parameters():
        p.requires_grad_(False)
    taps = eagle3.published_taps(5)
    assert taps == (1, 3, 4) and eagle3.published_taps(32) == (2, 16, 29)
    head = eagle3.PublishedEagle3Head.for_target(model, taps, inter=96).train()
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(3, 96, (4, 33), generator=gen)
    w[:, 16:] = w[:, :17]
    before = eagle3.eval_eagle3(head.eval(), model, w, torch.device("cpu"), steps=3, decay=0.8)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for _ in range(20):
        eagle3.eagle3_loss(head, model, w, steps=3, decay=0.8).backward()
        opt.step()
        opt.zero_grad()
    after = eagle3.eval_eagle3(head.eval(), model, w, torch.device("cpu"), steps=3, decay=0.8)
    assert after["eagle3_loss"] < before["eagle3_loss"] - 0.1
    assert all(p.grad is None for p in model.parameters())

    eagle3.save_published(head, tmp_path / "heads", dtype=torch.float32)
    info = public_heads.detect(tmp_path / "heads")
    assert info.layout == "EAGLE-3 (speculators)" and info.taps == taps and info.draft_vocab == 96
    runner = LlamaRunner.from_pretrained(tmp_path / "target", dtype=torch.float32)
    engine_head = PublicEagle3Head.load(info, runner)
    runner.tap_layers = engine_head.tap_layers
    assert engine_head.tap_layers == (0, 2, 3)

    ids = torch.tensor([0, 5, 17, 42, 7, 9, 11, 3, 30, 60, 21, 8])
    hf_taps, _ = eagle3.tapped_forward(model, ids[None], head.hook_layers)
    with torch.no_grad():
        outs = head.ttt(hf_taps[:, :11], model.model.embed_tokens(ids[None, 1:12]), steps=3)
        true = runner.forward(ids).taps
        h1 = _check_drafter_steps(engine_head, true, ids, outs)
        assert torch.allclose(engine_head.logits(h1), head.draft_logits(model, outs[0][0]), atol=1e-3)
