"""Properties of the torch reference (engine/kernels/reference.py): what the CUDA kernels are tested against.

CPU only; runs in CI.  Statistical tests use fixed seeds and a chi-square p-value from
torch.special.gammaincc.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import reference as ref


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of integer counts against probs (categories with p > 0)."""
    counts = counts.double()
    probs = probs.double()
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a zero-probability category was hit"
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def first_emitted(res: ref.VerifyResult, draft_tokens: torch.Tensor) -> torch.Tensor:
    """The first token a round emits: the first accepted draft, else the correction token."""
    first_node = res.path[:, 0].clamp(min=0)
    first_draft = draft_tokens.gather(1, first_node.unsqueeze(1)).squeeze(1)
    return torch.where(res.accepted > 0, first_draft, res.next_token)


def test_chain_parents():
    assert ref.chain_parents(4).tolist() == [-1, 0, 1, 2]


def test_greedy_chain_equals_stochastic_t0_one_hot():
    g = torch.Generator().manual_seed(0)
    B, K, V = 64, 5, 50
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    argmax = logits.argmax(-1)
    # drafts agree with the target's argmax for a random prefix length, then disagree
    draft = argmax[:, :K].clone()
    cut = torch.randint(0, K + 1, (B,), generator=g)
    for b in range(B):
        if cut[b] < K:
            draft[b, cut[b]] = (draft[b, cut[b]] + 1) % V
    u = torch.rand(B, K + 1, generator=g)
    gr = ref.verify_chain_greedy(logits, draft)
    st = ref.verify_chain_stochastic(logits, draft, None, u, temperature=0.0)
    assert torch.equal(gr.accepted, cut)
    assert torch.equal(gr.accepted, st.accepted)
    assert torch.equal(gr.next_token, st.next_token)
    assert torch.equal(gr.path, st.path)
    assert torch.equal(gr.tested, st.tested)
    assert torch.equal(gr.accept_prob, st.accept_prob)


def test_greedy_reproduces_plain_greedy_decoding():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 30, generator=g)
    draft = logits[:, :3].argmax(-1)
    res = ref.verify_chain_greedy(logits, draft)
    assert int(res.accepted) == 3
    assert int(res.next_token) == int(logits[0, 3].argmax())


def test_sample_matches_warp_probs():
    g = torch.Generator().manual_seed(2)
    V, R = 12, 40000
    logits = torch.randn(V, generator=g) * 2
    probs = ref.warp_probs(logits.unsqueeze(0), temperature=0.8, top_k=8, top_p=0.9)[0]
    tokens, tok_probs = ref.sample(logits.expand(R, V).contiguous(), torch.rand(R, generator=g), 0.8, 8, 0.9)
    counts = torch.bincount(tokens, minlength=V)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert torch.allclose(tok_probs, probs[tokens])


def test_chain_stochastic_first_token_follows_target():
    g = torch.Generator().manual_seed(3)
    V, K, B = 8, 2, 8000
    target = torch.randn(K + 1, V, generator=g)
    draft_logits = torch.randn(K, V, generator=g)
    q = torch.softmax(draft_logits, -1)
    draft = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(K)], dim=1)
    res = ref.verify_chain_stochastic(target.expand(B, K + 1, V), draft, q.expand(B, K, V),
                                      torch.rand(B, K + 1, generator=g), temperature=1.0)
    first = first_emitted(res, draft)
    p = torch.softmax(target[0], -1)
    assert chi2_pvalue(torch.bincount(first, minlength=V), p) > 1e-3
    # the acceptance rate of the first draft is sum_x min(p, q)
    rate = (res.accepted > 0).double().mean()
    assert abs(float(rate) - float(torch.minimum(p, q[0]).sum())) < 0.02


def test_chain_stochastic_with_top_p_and_one_hot_drafts():
    g = torch.Generator().manual_seed(4)
    V, K, B = 10, 3, 6000
    target = torch.randn(K + 1, V, generator=g) * 1.5
    draft = torch.randint(0, V, (B, K), generator=g)
    uniforms = torch.rand(B, K + 1, generator=g)
    res = ref.verify_chain_stochastic(target.expand(B, K + 1, V), draft, None, uniforms,
                                      temperature=0.7, top_k=0, top_p=0.8)
    p = ref.warp_probs(target[0:1], 0.7, 0, 0.8)[0]
    assert chi2_pvalue(torch.bincount(first_emitted(res, draft), minlength=V), p) > 1e-3


def test_tree_stochastic_one_hot_siblings_lossless():
    g = torch.Generator().manual_seed(5)
    V, B = 9, 8000
    # root with three children (distinct tokens), the first child has two children of its own
    parents = torch.tensor([-1, -1, -1, 0, 0])
    target = torch.randn(6, V, generator=g)
    draft = torch.tensor([2, 5, 7, 1, 3]).expand(B, 5).contiguous()
    res = ref.verify_tree_stochastic(target.expand(B, 6, V), draft, parents, None,
                                     torch.rand(B, 6, generator=g), temperature=1.0)
    p = torch.softmax(target[0], -1)
    assert chi2_pvalue(torch.bincount(first_emitted(res, draft), minlength=V), p) > 1e-3
    # a path through node 0 continues at node 3 or 4 only
    deep = res.accepted >= 2
    assert bool(((res.path[deep, 0] == 0) & ((res.path[deep, 1] == 3) | (res.path[deep, 1] == 4))).all())


def test_tree_stochastic_with_draft_distributions_lossless():
    g = torch.Generator().manual_seed(6)
    V, B = 7, 8000
    parents = torch.tensor([-1, -1])
    target = torch.randn(3, V, generator=g)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    # siblings drawn independently from their own q
    draft = torch.stack([torch.multinomial(q[i], B, replacement=True, generator=g) for i in range(2)], 1)
    res = ref.verify_tree_stochastic(target.expand(B, 3, V), draft, parents, q.expand(B, 2, V),
                                     torch.rand(B, 3, generator=g), temperature=1.0)
    p = torch.softmax(target[0], -1)
    assert chi2_pvalue(torch.bincount(first_emitted(res, draft), minlength=V), p) > 1e-3


def test_warp_probs_edge_rows():
    inf = float("inf")
    # -inf everywhere but one token
    row = torch.full((1, 6), -inf)
    row[0, 4] = 1.0
    for kw in ({}, {"top_k": 2}, {"top_p": 0.5}):
        assert ref.warp_probs(row, 1.3, **kw)[0].tolist() == [0, 0, 0, 0, 1, 0]
        tok, pr = ref.sample(row, torch.tensor([0.99]), 1.3, **kw)
        assert int(tok) == 4 and float(pr) == 1.0
    # T = 0: first index on ties
    assert ref.warp_probs(torch.tensor([[1.0, 3.0, 3.0]]), 0.0)[0].tolist() == [0, 1, 0]
    # top-k keeps ties
    p = ref.warp_probs(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), 1.0, top_k=1)[0]
    assert p[1] == p[2] == 0.5 and p[0] == 0 and p[3] == 0
    # top-p keeps every token as likely as the last one needed
    p = ref.warp_probs(torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]])), 1.0, top_p=0.5)[0]
    assert p[0] > 0 and p[1] > 0 and p[2] > 0 and p[3] > 0
    p = ref.warp_probs(torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]])), 1.0, top_p=0.6)[0]
    assert p[2] == 0 and p[3] == 0 and abs(float(p[0]) - 0.625) < 1e-6
    # NaN raises
    try:
        ref.warp_probs(torch.tensor([[0.0, float("nan")]]), 1.0)
    except ValueError:
        pass
    else:
        raise AssertionError("NaN did not raise")


def test_sample_from_probs_order_and_fallback():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.49, 0.5, 0.999999999])
    assert ref.sample_from_probs(probs, u).tolist() == [1, 1, 3, 3]
    # u = 1 would run off the end: falls back to the last non-zero token
    assert ref.sample_from_probs(probs[:1], torch.tensor([1.0])).tolist() == [3]


def test_residual_falls_back_to_p():
    p = torch.tensor([0.0, 1.0, 0.0])
    q = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(ref._residual(p, q, 1), p)
    out = ref._residual(torch.tensor([0.5, 0.5, 0.0]), None, 0)
    assert out.tolist() == [0.0, 1.0, 0.0]


def test_verify_records():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 4, 20, generator=g)
    draft = torch.randint(0, 20, (2, 3), generator=g)
    q = torch.softmax(torch.randn(2, 3, 20, generator=g), -1)
    res = ref.verify_chain_stochastic(logits, draft, q, torch.rand(2, 4, generator=g), 1.0)
    for b in range(2):
        a = int(res.accepted[b])
        assert res.tested[b, : min(a + 1, 3)].all() and not res.tested[b, a + 1:].any()
        assert res.path[b, :a].tolist() == list(range(a))
        tq = q[b, torch.arange(3), draft[b]]
        t = res.tested[b]
        assert torch.allclose(res.q_draft[b, t], tq[t])
        assert torch.allclose(res.accept_prob[b, t], torch.clamp(res.p_draft[b, t] / tq[t], max=1.0))


def test_readout_lays_out_the_verdict_then_each_rows_figures():
    """reference.readout: the verdict and drafted figures as given, then p of the next token in every row and
    each row's most probable tokens, under softmax(logits / T)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 1.0], [0.0, 0.0, 5.0, 0.0]])  # [R=3, V=4]
    draft = torch.tensor([1, 0])
    result = ref.verify_chain_greedy(logits[None], draft[None])  # 1 and 0 are the argmaxes: both accepted
    values = ref.readout(logits, result, draft, 1.0, 2).tolist()
    n, rows, width = 2, 3, 2
    assert values[:2] == [2.0, 2.0]  # accepted, next token (the last row's argmax)
    path, tokens, p, q, accept, tested = (values[2 + i * n:2 + (i + 1) * n] for i in range(6))
    assert path == [0.0, 1.0] and tokens == [1.0, 0.0] and q == [1.0, 1.0] and accept == [1.0, 1.0]
    assert tested == [1.0, 1.0]
    soft = torch.softmax(logits, -1)
    assert p == pytest.approx([float(soft[0, 1]), float(soft[1, 0])])
    next_p = values[2 + 6 * n:2 + 6 * n + rows]
    assert next_p == pytest.approx(soft[:, 2].tolist())
    top_p = values[2 + 6 * n + rows:2 + 6 * n + rows + rows * width]
    top_i = values[2 + 6 * n + rows + rows * width:]
    assert top_i == [1.0, 2.0, 0.0, 3.0, 2.0, 0.0] or top_i[:4] == [1.0, 2.0, 0.0, 3.0]  # row 2 ties at 0
    assert top_p[:4] == pytest.approx([float(soft[0, 1]), float(soft[0, 2]), float(soft[1, 0]),
                                       float(soft[1, 3])])
    warm = ref.readout(logits, result, draft, 0.5, 1).tolist()  # T = 0.5: p from softmax(2 x)
    assert warm[2 + 6 * n:2 + 6 * n + rows] == pytest.approx(torch.softmax(2 * logits, -1)[:, 2].tolist())
    with pytest.raises(ValueError):
        ref.readout(logits, result, draft, 1.0, 5)  # more alternatives than tokens


def test_greedy_readout_verifies_cuts_at_the_limit_and_reads_out():
    """reference.greedy_readout (sp_greedy_readout's twin): the greedy verdict of a chain or a tree, a chain
    cut at its real drafts, and the readout of that verdict at T = 1."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 1.0], [0.0, 0.0, 5.0, 0.0],
                           [1.0, 0.0, 0.0, 0.0]])  # [R=4, V=4]: argmaxes 1, 0, 2, 0
    chain = torch.tensor([1, 0, 3])  # matches rows 0 and 1, not row 2
    result, values = ref.greedy_readout(logits, chain, 2)
    assert result.accepted.tolist() == [2] and result.next_token.tolist() == [2]
    assert result.path.tolist() == [[0, 1, -1]] and result.tested.tolist() == [[True, True, True]]
    assert torch.equal(values, ref.readout(logits, result, chain, 1.0, 2))
    cut, cut_values = ref.greedy_readout(logits, chain, 2, limit=torch.tensor([1]), extra=1)
    # one real draft: accepted 1, the next token the chain's second (the target's argmax at row 1)
    assert cut.accepted.tolist() == [1] and cut.next_token.tolist() == [0]
    assert cut.path.tolist() == [[0, -1, -1]] and cut.tested.tolist() == [[True, False, False]]
    assert cut_values[:2].tolist() == [1.0, 0.0] and cut_values.numel() == values.numel() + 1
    parents = torch.tensor([-1, -1, 1])  # two roots: node 0 matches first, so nodes 1 and 2 are never tested
    tree, _ = ref.greedy_readout(logits, torch.tensor([1, 0, 0]), 2, parents=parents)
    assert tree.accepted.tolist() == [1] and tree.next_token.tolist() == [0]  # row 1's argmax after node 0
    assert tree.tested.tolist() == [[True, False, False]]
    plain, plain_values = ref.greedy_readout(logits[:1], torch.empty(0, dtype=torch.long), 3)
    assert plain.accepted.tolist() == [0] and plain.next_token.tolist() == [1]
    assert plain_values.numel() == 2 + 1 + 2 * 3
