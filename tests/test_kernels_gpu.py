"""CUDA kernels (engine/kernels/cuda.py) against the torch reference on the same GPU tensors.

Marked `gpu`; skipped with a reason when CUDA or CuPy is missing.  `pytest --fuzz-cases N` sets the number of
fuzz cases per kernel (default 10,000).  Token/accept decisions must be identical; a case may differ only when
it is numerically ambiguous (the reference's fp32 sums put top_p, u * total or u itself within rounding
distance of a boundary), and such cases must stay rare (<= 0.2 % of cases).
"""
from __future__ import annotations

import pytest
import torch
from fuzz import cases as fuzz_cases

from engine.kernels import reference as ref
from engine.models.runner import graph_capture, warm_up_stream

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
try:
    from engine.kernels import cuda as kc
except ImportError as exc:  # no CuPy, or CuPy without a device
    pytest.skip(f"CuPy backend unavailable: {exc}", allow_module_level=True)

N_CASES = fuzz_cases(10000)
DEV = torch.device("cuda")
AMBIG_FRACTION = 0.002
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _logits(g, rows, vocab, dtype, kind):
    x = torch.randn(rows, vocab, generator=g, device=DEV) * float(torch.empty(1).uniform_(0.3, 6.0))
    if kind == 1:  # many -inf
        x = x.masked_fill(torch.rand(rows, vocab, generator=g, device=DEV) < 0.7, float("-inf"))
        x[:, int(torch.randint(0, vocab, (1,)))] = 0.5
    elif kind == 2:  # -inf everywhere but one token
        keep = torch.randint(0, vocab, (rows,), generator=g, device=DEV)
        x = torch.full_like(x, float("-inf"))
        x[torch.arange(rows, device=DEV), keep] = 1.0
    elif kind == 3:  # coarse values: many ties
        x = torch.round(x)
    return x.to(dtype)


def _rand_cfg(g):
    r = torch.rand(4, generator=g).tolist()
    temp = 0.0 if r[0] < 0.15 else float(0.2 + 2.0 * r[1])
    top_k = 0 if r[2] < 0.5 else int(torch.randint(1, 40, (1,), generator=g))
    top_p = 1.0 if r[3] < 0.5 else float(0.05 + 0.94 * torch.rand(1, generator=g))
    return temp, top_k, top_p


def _topp_ambiguous(logits, temp, top_k, top_p, tol=3e-5):
    """Rows whose top-p cut lies within fp32-cumsum rounding of a cumulative-mass boundary."""
    rows = logits.reshape(-1, logits.shape[-1])
    if temp == 0.0 or top_p >= 1.0:
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    probs = ref.warp_probs(rows, temp, top_k, 1.0).double()
    sp, _ = torch.sort(probs, -1, descending=True)
    before = torch.cumsum(sp, -1) - sp
    return ((before - top_p).abs() < tol).any(-1)


def _cdf_ambiguous(probs, u, tol=1e-6):
    cdf = torch.cumsum(probs.double(), -1)
    target = u.double().unsqueeze(-1) * cdf[:, -1:]
    return ((cdf - target).abs() < tol * cdf[:, -1:]).any(-1)


def _fuzz_vocab(g):
    r = float(torch.rand(1, generator=g))
    if r < 0.1:
        return int(torch.randint(2, 16, (1,), generator=g))
    if r < 0.9:
        return int(torch.randint(16, 3000, (1,), generator=g))
    return int(torch.randint(3000, 20000, (1,), generator=g))


def test_sample_and_warp_fuzz():
    _sample_fuzz(N_CASES, 11)


def _sample_fuzz(n_cases: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed + 1)
    done = mism = ambig = 0
    while done < n_cases:
        vocab = _fuzz_vocab(gc)
        rows = int(torch.randint(1, 100, (1,), generator=gc))
        dtype = DTYPES[int(torch.randint(0, 3, (1,), generator=gc))]
        kind = int(torch.randint(0, 4, (1,), generator=gc))
        temp, top_k, top_p = _rand_cfg(gc)
        x = _logits(g, rows, vocab, dtype, kind)
        u = torch.rand(rows, generator=g, device=DEV)
        rp = ref.warp_probs(x, temp, top_k, top_p)
        kp = kc.warp_probs(x, temp, top_k, top_p)
        rt, rq = ref.sample(x, u, temp, top_k, top_p)
        kt, kq = kc.sample(x, u, temp, top_k, top_p)
        ks = kc.sample_from_probs(rp, u)
        rs = ref.sample_from_probs(rp, u)
        amb = _topp_ambiguous(x, temp, top_k, top_p) | _cdf_ambiguous(rp, u)
        bad = (rt != kt) | (rs != ks) | ~torch.isclose(kq, rq, rtol=1e-5, atol=1e-7)
        bad |= ~torch.isclose(kp, rp, rtol=1e-5, atol=1e-7).all(-1)
        if bool(bad.any()):
            unexplained = bad & ~amb
            assert not bool(unexplained.any()), (
                f"mismatch: V={vocab} dtype={dtype} kind={kind} T={temp} k={top_k} p={top_p} rows="
                f"{unexplained.nonzero().flatten().tolist()[:5]} ref={rt[unexplained][:5].tolist()} "
                f"kernel={kt[unexplained][:5].tolist()}")
            mism += int(bad.sum())
        ambig += int(amb.sum())
        done += rows
    assert mism <= max(2, AMBIG_FRACTION * done), f"{mism} ambiguous mismatches out of {done}"
    print(f"sample fuzz: {done} rows, {mism} ambiguous mismatches ({ambig} ambiguous rows)")


def _compare_verify(r, k, amb=None):
    bad = (r.accepted != k.accepted) | (r.next_token != k.next_token) | (r.path != k.path).any(-1)
    bad |= (r.tested != k.tested).any(-1)
    for a, b in ((r.p_draft, k.p_draft), (r.q_draft, k.q_draft), (r.accept_prob, k.accept_prob)):
        bad |= ~torch.isclose(a, b, rtol=1e-5, atol=1e-7).all(-1)
    return bad


def _verify_fuzz(tree: bool, stochastic: bool, seed: int, n_cases: int = N_CASES):
    g = torch.Generator(device=DEV).manual_seed(seed)
    gc = torch.Generator().manual_seed(seed + 1)
    done = mism = 0
    while done < n_cases:
        if float(torch.rand(1, generator=gc)) < 0.7:
            vocab = _fuzz_vocab(gc)
        else:
            vocab = int(torch.randint(2, 64, (1,), generator=gc))
        batch = int(torch.randint(1, 40, (1,), generator=gc))
        n = int(torch.randint(1, 12, (1,), generator=gc))
        dtype = DTYPES[int(torch.randint(0, 3, (1,), generator=gc))]
        kind = int(torch.randint(0, 4, (1,), generator=gc))
        temp, top_k, top_p = _rand_cfg(gc)
        if tree:
            parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gc))
                                           for i in range(1, n)])
        else:
            parents = ref.chain_parents(n)
        x = _logits(g, batch * (n + 1), vocab, dtype, kind).reshape(batch, n + 1, vocab)
        use_q = stochastic and float(torch.rand(1, generator=gc)) < 0.5
        q = None
        if use_q:
            q = torch.softmax(torch.randn(batch, n, vocab, generator=g, device=DEV) * 2, -1)
            drop = torch.rand(batch, n, vocab, generator=g, device=DEV) < 0.2
            q = q.masked_fill(drop & (q < q.amax(-1, keepdim=True)), 0.0)  # never empty a row
            q = q / q.sum(-1, keepdim=True)
            draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, n)
        else:
            # half the drafts copy the target's argmax at their parent (so paths get long), half are random
            parent_rows = (parents + 1).to(DEV)
            am = x.float().argmax(-1)[:, parent_rows]
            rnd = torch.randint(0, vocab, (batch, n), generator=g, device=DEV)
            draft = torch.where(torch.rand(batch, n, generator=g, device=DEV) < 0.6, am, rnd)
        u = torch.rand(batch, n + 1, generator=g, device=DEV)
        if stochastic:
            if tree:
                r = ref.verify_tree_stochastic(x, draft, parents, q, u, temp, top_k, top_p)
                k = kc.verify_tree_stochastic(x, draft, parents, q, u, temp, top_k, top_p)
            else:
                r = ref.verify_chain_stochastic(x, draft, q, u, temp, top_k, top_p)
                k = kc.verify_chain_stochastic(x, draft, q, u, temp, top_k, top_p)
        else:
            if tree:
                r = ref.verify_tree_greedy(x, draft, parents)
                k = kc.verify_tree_greedy(x, draft, parents)
            else:
                r = ref.verify_chain_greedy(x, draft)
                k = kc.verify_chain_greedy(x, draft)
        bad = _compare_verify(r, k)
        if bool(bad.any()):
            amb = _topp_ambiguous(x, temp, top_k, top_p).reshape(batch, n + 1).any(-1)
            amb |= (r.tested & ((u[:, :n] - r.accept_prob).abs() < 1e-5)).any(-1)
            # final-sample ambiguity needs the (residual) distribution; count those against the budget
            mism += int(bad.sum())
            unexplained = int((bad & ~amb).sum())
            assert unexplained <= 1, (
                f"mismatch: tree={tree} stoch={stochastic} V={vocab} B={batch} N={n} {dtype} kind={kind} "
                f"T={temp} k={top_k} p={top_p} q={use_q} ref acc={r.accepted[bad].tolist()[:4]} "
                f"next={r.next_token[bad].tolist()[:4]}"
                f" kernel acc={k.accepted[bad].tolist()[:4]} next={k.next_token[bad].tolist()[:4]}")
        done += batch
    assert mism <= max(2, AMBIG_FRACTION * done), f"{mism} ambiguous mismatches out of {done}"
    print(f"verify fuzz tree={tree} stochastic={stochastic}: {done} cases, {mism} ambiguous mismatches")


def test_verify_chain_greedy_fuzz():
    _verify_fuzz(tree=False, stochastic=False, seed=21)


def test_verify_tree_greedy_fuzz():
    _verify_fuzz(tree=True, stochastic=False, seed=31)


def test_verify_chain_stochastic_fuzz():
    _verify_fuzz(tree=False, stochastic=True, seed=41)


def test_verify_tree_stochastic_fuzz():
    _verify_fuzz(tree=True, stochastic=True, seed=51)


@pytest.fixture
def wide_everywhere():
    """Route every eligible call (sampling / chain verification without top-k, top-p) to the wide kernel."""
    old = kc.WIDE_MIN_V
    kc.WIDE_MIN_V = 1
    yield
    kc.WIDE_MIN_V = old


def test_wide_sample_fuzz(wide_everywhere):
    _sample_fuzz(max(1, N_CASES // 2), 13)


def test_wide_verify_chain_greedy_fuzz(wide_everywhere):
    _verify_fuzz(tree=False, stochastic=False, seed=23, n_cases=max(1, N_CASES // 2))


def test_wide_verify_chain_stochastic_fuzz(wide_everywhere):
    _verify_fuzz(tree=False, stochastic=True, seed=43, n_cases=max(1, N_CASES // 2))


def test_wide_off_matches_large_vocab():
    """The one-block-per-row kernels and the wide kernel agree at large V (T = 1, no truncation)."""
    g = torch.Generator(device=DEV).manual_seed(81)
    x = torch.randn(2, 9, 151936, generator=g, device=DEV) * 3
    q = torch.softmax(torch.randn(2, 8, 151936, generator=g, device=DEV) * 3, -1)
    draft = torch.multinomial(q.reshape(-1, 151936), 1, generator=g).reshape(2, 8)
    draft[0, :3] = x[0, :3].argmax(-1)
    u = torch.rand(2, 9, generator=g, device=DEV)
    old = kc.WIDE_MIN_V
    try:
        outs = []
        for wmv in (1, 0):
            kc.WIDE_MIN_V = wmv
            outs.append((kc.verify_chain_stochastic(x, draft, q, u, 1.0), kc.verify_chain_greedy(x, draft),
                         kc.sample(x[:, 0], u[:, 0], 1.0)))
    finally:
        kc.WIDE_MIN_V = old
    (a1, a2, a3), (b1, b2, b3) = outs
    assert not bool(_compare_verify(a1, b1).any()) and not bool(_compare_verify(a2, b2).any())
    assert torch.equal(a3[0], b3[0]) and torch.allclose(a3[1], b3[1], rtol=1e-5)
    r = ref.verify_chain_stochastic(x, draft, q, u, 1.0)
    assert not bool(_compare_verify(r, a1).any())


def test_large_vocab_and_k64():
    g = torch.Generator(device=DEV).manual_seed(61)
    for vocab in (151936, 262144):
        x = torch.randn(3, 65, vocab, generator=g, device=DEV) * 4
        draft = x[:, :64].argmax(-1)
        draft[1, 10] = (draft[1, 10] + 1) % vocab
        u = torch.rand(3, 65, generator=g, device=DEV)
        for args in ((1.0, 0, 1.0), (0.7, 50, 0.9), (0.0, 0, 1.0)):
            r = ref.verify_chain_stochastic(x, draft, None, u, *args)
            k = kc.verify_chain_stochastic(x, draft, None, u, *args)
            assert not bool(_compare_verify(r, k).any()), args
        rt, rq = ref.sample(x[:, 0], u[:, 0], 0.9, 0, 0.95)
        kt, kq = kc.sample(x[:, 0], u[:, 0], 0.9, 0, 0.95)
        assert torch.equal(rt, kt) and torch.allclose(rq, kq, rtol=1e-5)


def test_sample_statistics_top_p():
    g = torch.Generator(device=DEV).manual_seed(71)
    vocab, rows = 64, 200000
    logits = torch.randn(vocab, generator=g, device=DEV) * 2
    probs = torch.softmax(logits / 0.9, -1).double()
    sp, idx = torch.sort(probs, descending=True)
    keep = (torch.cumsum(sp, 0) - sp) < 0.8
    expected = torch.zeros_like(probs)
    expected[idx[keep]] = probs[idx[keep]]
    expected /= expected.sum()
    tokens, _ = kc.sample(logits.expand(rows, vocab).contiguous(), torch.rand(rows, generator=g, device=DEV),
                          0.9, 0, 0.8)
    counts = torch.bincount(tokens, minlength=vocab).cpu().double()
    exp = expected.cpu()
    assert counts[exp == 0].sum() == 0
    nz = exp > 0
    e = exp[nz] * rows
    stat = ((counts[nz] - e) ** 2 / e).sum()
    dof = torch.tensor((int(nz.sum()) - 1) / 2.0, dtype=torch.float64)
    pval = float(torch.special.gammaincc(dof, stat / 2))
    assert pval > 1e-3


def test_nan_raises():
    x = torch.randn(2, 100, device=DEV)
    x[1, 7] = float("nan")
    u = torch.rand(2, device=DEV)
    tokens, _ = kc.sample(x, u, 1.0)
    with pytest.raises(ValueError, match="NaN"):
        kc.check_nan()
    assert tokens.tolist()[1] == -1
    kc.sample(x, u, 1.0)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="NaN"):  # lazily, at the next call
        kc.warp_probs(x[:1], 1.0)
    xv = torch.randn(1, 3, 100, device=DEV)
    xv[0, 2, 3] = float("nan")
    res = kc.verify_chain_stochastic(xv, torch.zeros(1, 2, dtype=torch.long, device=DEV), None,
                                     torch.rand(1, 3, device=DEV), 1.0)
    with pytest.raises(ValueError, match="NaN"):
        kc.check_nan()
    assert int(res.accepted) == -1
    kc.check_nan()  # cleared


def test_input_validation():
    x = torch.randn(2, 100, device=DEV)
    with pytest.raises(ValueError):
        kc.sample(x.double(), torch.rand(2, device=DEV), 1.0)
    with pytest.raises(ValueError):
        kc.sample(x, torch.rand(3, device=DEV), 1.0)
    with pytest.raises(ValueError):
        kc.sample(x.cpu(), torch.rand(2), 1.0)
    # non-contiguous input is made contiguous
    xt = torch.randn(100, 2, device=DEV).t()
    u = torch.rand(2, device=DEV)
    assert torch.equal(kc.sample(xt, u, 0.0)[0], ref.sample(xt, u, 0.0)[0])
    with pytest.raises(ValueError):
        kc.verify_tree_greedy(torch.randn(1, 3, 10, device=DEV),
                              torch.zeros(1, 2, dtype=torch.long, device=DEV), torch.tensor([-1, 1]))


def test_select_backend():
    from engine.kernels import Backend, select_backend
    from engine.kernels.backend import MEMBERS
    backend = select_backend(torch.device("cuda"))
    assert backend is kc.BACKEND and backend.name == "cupy-raw-kernels"
    assert isinstance(backend, Backend) and backend.compiles_kernels and backend.flags_nan_on_device
    assert set(vars(backend)) == set(MEMBERS)


def test_device_state_is_built_once_and_launches_directly():
    kc.warm_up(DEV)
    index = torch.cuda.current_device()
    state = kc._device(index)
    assert state is kc._device(index) and state.index == index
    assert set(state.kernels) == set(kc._NAMES)
    assert state.fast_launch  # the self-check passed: launches go straight to cuLaunchKernel


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_empty_draft_matches_reference(temperature):
    """Plain decoding verifies an empty draft: the next token is the argmax or a sample of the root row."""
    g = torch.Generator(device=DEV).manual_seed(5)
    logits = torch.randn(4, 1, 5000, device=DEV, generator=g) * 3
    tokens = torch.empty(4, 0, dtype=torch.long, device=DEV)
    uniforms = torch.rand(4, 1, device=DEV, generator=g)
    if temperature == 0.0:
        got, want = kc.verify_chain_greedy(logits, tokens), ref.verify_chain_greedy(logits, tokens)
    else:
        got = kc.verify_chain_stochastic(logits, tokens, None, uniforms, temperature, 0, 0.9)
        want = ref.verify_chain_stochastic(logits, tokens, None, uniforms, temperature, 0, 0.9)
    assert torch.equal(got.next_token.cpu(), want.next_token.cpu())
    assert torch.equal(got.accepted.cpu(), torch.zeros(4, dtype=torch.long))
    assert got.path.shape == (4, 0)


def _compare_readout(x, r, k, n, rows, width):
    """Exact verdict; close figures; top ids equal, or tied with the reference's (same logit) or of p 0."""
    head = 2 + 6 * n
    assert torch.equal(r[:head], k[:head])
    np_r, np_k = r[head:head + rows], k[head:head + rows]
    tp_r = r[head + rows:head + rows + rows * width].reshape(rows, width)
    tp_k = k[head + rows:head + rows + rows * width].reshape(rows, width)
    ti_r = r[head + rows + rows * width:].reshape(rows, width).long()
    ti_k = k[head + rows + rows * width:].reshape(rows, width).long()
    assert torch.allclose(np_r, np_k, rtol=2e-5, atol=1e-7), (np_r, np_k)
    assert torch.allclose(tp_r, tp_k, rtol=2e-5, atol=1e-7), (tp_r, tp_k)
    differ = ti_r != ti_k
    if bool(differ.any()):
        rows_of = torch.arange(rows, device=x.device)[:, None].expand(rows, width)
        tied = x.float()[rows_of, ti_r] == x.float()[rows_of, ti_k]
        assert bool((~differ | tied | (tp_r == 0)).all()), (ti_r, ti_k)


def _readout_case(gc, case: int) -> tuple:
    """A readout fuzz case's (vocab, drafted nodes, width, dtype): every 50th a vocabulary past 100k, every
    20th a long block."""
    vocab = _fuzz_vocab(gc) if case % 50 else int(torch.randint(100000, 262145, (1,), generator=gc))
    n = int(torch.randint(0, 12, (1,), generator=gc)) if case % 20 else int(torch.randint(12, 65, (1,),
                                                                                          generator=gc))
    width = int(torch.randint(1, min(8, vocab) + 1, (1,), generator=gc))
    return vocab, n, width, DTYPES[int(torch.randint(0, 3, (1,), generator=gc))]


def test_readout_fuzz():
    """sp_readout against reference.readout: random rows, vocabularies, dtypes, ties, -inf, temperatures."""
    g = torch.Generator(device=DEV).manual_seed(77)
    gc = torch.Generator().manual_seed(78)
    for case in range(N_CASES):
        vocab, n, width, dtype = _readout_case(gc, case)
        kind = int(torch.randint(0, 4, (1,), generator=gc))
        warm = float(torch.rand(1, generator=gc)) < 0.5
        temp = float(0.2 + 1.8 * torch.rand(1, generator=gc)) if warm else 1.0
        x = _logits(g, n + 1, vocab, dtype, kind)
        # drafts that copy the row's argmax half the time, so verdicts vary
        draft = torch.where(torch.rand(n, generator=g, device=DEV) < 0.5, x.float().argmax(-1)[:n],
                            torch.randint(0, vocab, (n,), generator=g, device=DEV))
        result = kc.verify_chain_greedy(x[None], draft[None])
        r = ref.readout(x, result, draft, temp, width)
        k = kc.readout(x, result, draft, temp, width)
        rows = n + 1
        assert k.shape == r.shape == (2 + 6 * n + rows + 2 * rows * width,)
        _compare_readout(x, r, k, n, rows, width)
    print(f"readout fuzz: {N_CASES} cases")


def _random_parents(gc, n: int) -> torch.Tensor:
    """A topologically ordered tree of n nodes: parents[i] in -1..i-1."""
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=gc)) for i in range(n)], dtype=torch.long)


def _greedy_drafts(g, x, parents, vocab):
    """Each node's token: its parent row's argmax 60% of the time (so verdicts go deep), else random."""
    n = parents.numel()
    want = x.float().argmax(-1)[(parents + 1).to(DEV)]  # [N]
    return torch.where(torch.rand(n, generator=g, device=DEV) < 0.6, want,
                       torch.randint(0, vocab, (n,), generator=g, device=DEV))


def test_greedy_readout_fuzz():
    """sp_greedy_readout against reference.greedy_readout (verify_tree_greedy, chain_limit_reference, readout
    at T = 1): chains and trees, with and without a chain's limit, every dtype, ties and -inf. The verdict
    is exact; p_draft within rounding; the readout's figures bit for bit those of sp_readout given the
    verdict."""
    g = torch.Generator(device=DEV).manual_seed(91)
    gc = torch.Generator().manual_seed(92)
    for case in range(N_CASES):
        vocab, n, width, dtype = _readout_case(gc, case)
        x = _logits(g, n + 1, vocab, dtype, int(torch.randint(0, 4, (1,), generator=gc)))
        tree = n > 0 and float(torch.rand(1, generator=gc)) < 0.4
        parents = _random_parents(gc, n) if tree else torch.arange(-1, n - 1)
        draft = _greedy_drafts(g, x, parents, vocab)
        limit = None
        if not tree and n > 0 and float(torch.rand(1, generator=gc)) < 0.4:
            limit = torch.randint(0, n + 1, (1,), generator=gc).to(DEV)
        tree_arg = parents if tree else None
        want, r = ref.greedy_readout(x, draft, width, tree_arg, limit, extra=1)
        got, k = kc.greedy_readout(x, draft, width, tree_arg, limit, extra=1)
        for name in ("accepted", "next_token", "path", "q_draft", "accept_prob", "tested"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (case, name)
        assert torch.allclose(got.p_draft, want.p_draft, rtol=2e-5, atol=1e-7), case
        rows, head = n + 1, 2 + 6 * n
        assert k.shape == r.shape == (head + rows + 2 * rows * width + 1,)
        alone = kc.readout(x, got, draft, 1.0, width)  # sp_readout given this verdict
        assert torch.equal(k[:-1], alone), case
        # against the reference's figures: the header but p_draft exact, the rest as test_readout_fuzz's
        p_part = slice(2 + 2 * n, 2 + 3 * n)
        assert torch.allclose(k[p_part], r[p_part], rtol=2e-5, atol=1e-7), case
        k_ref_p = k[:-1].clone()
        k_ref_p[p_part] = r[p_part]
        _compare_readout(x, r[:-1], k_ref_p, n, rows, width)
    print(f"greedy readout fuzz: {N_CASES} cases")


def test_greedy_readout_flags_nan_and_replays_its_eager_results():
    """A NaN anywhere in the block: accepted = next_token = -1 and the flag raised once; a captured launch
    replays to its eager results."""
    x = torch.randn(4, 300, device=DEV)
    x[2, 5] = float("nan")
    draft = x.argmax(-1)[:3]
    result, values = kc.greedy_readout(x, draft, 4)
    with pytest.raises(ValueError, match="NaN"):
        kc.check_nan()
    assert int(result.accepted) == -1 and int(result.next_token) == -1 and values[:2].tolist() == [-1.0, -1.0]
    kc.check_nan()  # cleared
    x = torch.randn(6, 8192, device=DEV).to(torch.bfloat16)
    draft, limit = x.float().argmax(-1)[:5], torch.tensor([3], device=DEV)
    eager = kc.greedy_readout(x, draft, 8, limit=limit)
    graph = torch.cuda.CUDAGraph()
    with warm_up_stream(x.device):  # the capture's stream: its workspace exists before the capture
        kc.greedy_readout(x, draft, 8, limit=limit)
    with graph_capture(graph, None, x.device):  # the product's guards (no cyclic collection inside)
        captured = kc.greedy_readout(x, draft, 8, limit=limit)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager[0], captured[0]))
    assert torch.equal(eager[1], captured[1])
    assert int(eager[0].accepted) == 3 and int(eager[0].next_token) == int(draft[3])


def test_readout_of_an_empty_draft_and_of_a_tree():
    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(1, 32000, generator=g, device=DEV).to(torch.bfloat16)
    empty = torch.empty(0, dtype=torch.long, device=DEV)
    result = kc.verify_chain_greedy(x[None], empty[None])
    _compare_readout(x, ref.readout(x, result, empty, 1.0, 5), kc.readout(x, result, empty, 1.0, 5), 0, 1, 5)
    x = torch.randn(9, 5000, generator=g, device=DEV) * 3
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4])
    draft = x.argmax(-1)[(parents + 1).to(DEV)]
    result = kc.verify_tree_greedy(x[None], draft[None], parents)
    _compare_readout(x, ref.readout(x, result, draft, 0.7, 5), kc.readout(x, result, draft, 0.7, 5), 8, 9, 5)
