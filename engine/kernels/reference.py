"""Torch reference for sampling and verification: the contract the CuPy kernels implement.

Every function takes caller-supplied uniforms in [0, 1), so that the kernels and this reference give the same
answer for the same inputs; that is how the GPU path is tested. Trees are given as parent indices in
topological order (parents[i] < i, -1 = the last committed token, the "root"); a chain of K drafts is the tree
with parents [-1, 0, 1, ..., K-2].

Target logits for a block of N drafted nodes come as [B, N+1, V]: row 0 is the root's distribution (over its
children), row i+1 is node i's distribution (over node i's children, or the bonus token when i is a leaf).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class VerifyResult(NamedTuple):
    accepted: torch.Tensor  # [B] int64: drafted tokens accepted (length of the accepted path)
    next_token: torch.Tensor  # [B] int64: correction (after a rejection) or bonus token
    path: torch.Tensor  # [B, N] int64: accepted node indices in order, padded with -1
    p_draft: torch.Tensor  # [B, N] float32: target prob of each drafted token when tested (0 if never tested)
    q_draft: torch.Tensor  # [B, N] float32: draft prob of each drafted token (1 for one-hot drafts)
    accept_prob: torch.Tensor  # [B, N] float32: min(1, p/q) when tested, else 0
    tested: torch.Tensor  # [B, N] bool: the node's acceptance test ran


def chain_parents(k: int, device=None) -> torch.Tensor:
    """Parents of a chain of k drafts: [-1, 0, 1, ..., k-2]."""
    return torch.arange(-1, k - 1, dtype=torch.long, device=device)


# ----------------------------------------------------------------------------------------------- sampling
def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution of logits [..., V] -> probs [..., V] float32.

    temperature 0 gives the one-hot argmax (first index on ties). top_k keeps tokens whose logit is >= the
    k-th largest (ties kept); top_p keeps the smallest set of most likely tokens whose mass reaches top_p
    (every token as likely as the last one kept is kept too); the rest get probability 0 and the kept mass
    is renormalised. NaN logits raise ValueError.
    """
    logits = logits.float()
    if torch.isnan(logits).any():
        raise ValueError("NaN in logits")
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # the smallest prob still needed to reach top_p: the last sorted entry whose preceding mass < top_p
        needed = mass_before < top_p
        threshold = torch.where(needed, sorted_probs, torch.ones_like(sorted_probs)).amin(-1, keepdim=True)
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in token-id order: probs [R, V], uniforms [R] -> tokens [R] int64.

    The token is the first index whose cumulative mass exceeds u * total; rounding at the top end falls back
    to the last token with non-zero probability."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [R, V]
    target = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last_nonzero)


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int = 0,
           top_p: float = 1.0):
    """Sample one token per row: logits [R, V], uniforms [R] -> (tokens [R] int64, token_probs [R] float32).

    token_probs is the warped probability of the chosen token (the draft side's q(x))."""
    probs = warp_probs(logits, temperature, top_k, top_p)
    tokens = sample_from_probs(probs, uniforms)
    return tokens, probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------- verification
def _children(parents: list, node: int) -> list:
    return [i for i, p in enumerate(parents) if p == node]


def _empty_result(batch: int, n: int, device) -> dict:
    return {
        "accepted": torch.zeros(batch, dtype=torch.long, device=device),
        "next_token": torch.zeros(batch, dtype=torch.long, device=device),
        "path": torch.full((batch, n), -1, dtype=torch.long, device=device),
        "p_draft": torch.zeros(batch, n, dtype=torch.float32, device=device),
        "q_draft": torch.ones(batch, n, dtype=torch.float32, device=device),
        "accept_prob": torch.zeros(batch, n, dtype=torch.float32, device=device),
        "tested": torch.zeros(batch, n, dtype=torch.bool, device=device),
    }


def verify_tree_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                       parents: torch.Tensor, chained: bool = False) -> VerifyResult:
    """Greedy verification: follow the longest path whose tokens equal the target's argmax (chained: the
    CUDA backend's launch option, nothing here).

    target_logits [B, N+1, V], draft_tokens [B, N], parents [N] (shared by the batch). p_draft reports the
    T=1 softmax probability of each tested token; accept_prob is 1 for a match, else 0."""
    batch, n = draft_tokens.shape
    if torch.isnan(target_logits).any():
        raise ValueError("NaN in target logits")
    out = _empty_result(batch, n, target_logits.device)
    parent_list = parents.tolist()
    argmax = target_logits.float().argmax(-1)  # [B, N+1]
    soft = torch.softmax(target_logits.float(), dim=-1)
    for b in range(batch):
        node, depth = -1, 0
        while True:
            want = int(argmax[b, node + 1])
            match = None
            for c in _children(parent_list, node):
                out["tested"][b, c] = True
                out["p_draft"][b, c] = soft[b, node + 1, draft_tokens[b, c]]
                if int(draft_tokens[b, c]) == want:
                    out["accept_prob"][b, c] = 1.0
                    match = c
                    break
            if match is None:
                out["next_token"][b] = want
                break
            out["path"][b, depth] = match
            depth += 1
            node = match
        out["accepted"][b] = depth
    return VerifyResult(**out)


def verify_tree_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                           draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                           top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Lossless recursive rejection sampling over a token tree (speculative sampling for a chain).

    target_logits [B, N+1, V]; draft_tokens [B, N]; parents [N]; draft_probs [B, N, V]: the distribution
    node i was drawn from (None: one-hot, a deterministic drafter); uniforms [B, N+1]: u[:, i] tests node i,
    u[:, N] samples the correction / bonus token. At a node, children are tried in index order: child x is
    accepted with probability min(1, p(x)/q(x)); on rejection p becomes normalize(max(p - q, 0)) before the
    next sibling is tried; when no child is accepted the next token is sampled from the current p (the
    residual after a rejection, the plain target distribution at a leaf: the bonus token).
    """
    batch, n = draft_tokens.shape
    out = _empty_result(batch, n, target_logits.device)
    probs = warp_probs(target_logits, temperature, top_k, top_p)  # [B, N+1, V]
    parent_list = parents.tolist()
    for b in range(batch):
        node, depth = -1, 0
        p = probs[b, 0]
        while True:
            match = None
            for c in _children(parent_list, node):
                x = int(draft_tokens[b, c])
                q = draft_probs[b, c].float() if draft_probs is not None else None
                qx = float(q[x]) if q is not None else 1.0
                px = float(p[x])
                accept = 1.0 if qx <= 0.0 else min(1.0, px / qx)
                out["tested"][b, c] = True
                out["p_draft"][b, c], out["q_draft"][b, c], out["accept_prob"][b, c] = px, qx, accept
                if float(uniforms[b, c]) < accept:
                    match = c
                    break
                p = _residual(p, q, x)
            if match is None:
                out["next_token"][b] = sample_from_probs(p.unsqueeze(0), uniforms[b, n:n + 1])[0]
                break
            out["path"][b, depth] = match
            depth += 1
            node = match
            p = probs[b, node + 1]
        out["accepted"][b] = depth
    return VerifyResult(**out)


def _residual(p: torch.Tensor, q: Optional[torch.Tensor], x: int) -> torch.Tensor:
    """normalize(max(p - q, 0)); q None means one-hot at x. Falls back to p if nothing is left."""
    if q is None:
        q = torch.zeros_like(p)
        q[x] = 1.0
    rest = torch.clamp(p - q, min=0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def verify_chain_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                        chained: bool = False) -> VerifyResult:
    """Greedy chain verification: accept while draft == argmax. target_logits [B, K+1, V], draft [B, K]
    (chained: the CUDA backend's launch option, nothing here)."""
    return verify_tree_greedy(target_logits, draft_tokens, chain_parents(draft_tokens.shape[1]))


def verify_chain_stochastic(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                            draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor, temperature: float,
                            top_k: int = 0, top_p: float = 1.0) -> VerifyResult:
    """Standard speculative sampling over a chain (see verify_tree_stochastic). uniforms [B, K+1]."""
    return verify_tree_stochastic(target_logits, draft_tokens, chain_parents(draft_tokens.shape[1]),
                                  draft_probs, uniforms, temperature, top_k, top_p)


# ----------------------------------------------------------------------------------------------- readout
def readout(logits: torch.Tensor, result: VerifyResult, draft_tokens: torch.Tensor, temperature: float,
            width: int, extra: int = 0, chained: bool = False) -> torch.Tensor:
    """Everything the host reads of a one-sequence round, as one float32 vector (ids exact below 2**24):
    [accepted, next_token, path[N], draft[N], p[N], q[N], accept_prob[N], tested[N], next_p[R], top_p[R, W],
    top_i[R, W]] for logits [R = N + 1, V], result of that round's verification (batch 1) and draft_tokens
    [N]. Under p = softmax(logits / temperature): next_p[r] is row r's p of the next token, top_* its W most
    probable tokens, most probable first (tied tokens in either order; the CUDA kernel puts the smaller id
    first). extra: float32 slots after them (zeros) for the caller to fill (n-gram's count of real drafts).
    chained: the CUDA backend's launch option, nothing here."""
    rows, vocab = logits.shape
    if not 1 <= width <= vocab:
        raise ValueError(f"width must be in 1..{vocab}, got {width}")
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    soft = torch.softmax(scaled, dim=-1)  # [R, V]
    top_p, top_i = torch.topk(soft, width, dim=-1)  # [R, W]
    next_token = result.next_token[:1]  # [1]
    next_p = soft.index_select(1, next_token.clamp(0, vocab - 1)).flatten()  # [R]
    # one cat, its dtype promotion turning ids and flags into float32
    return torch.cat([result.accepted[:1], next_token, result.path[0], draft_tokens, result.p_draft[0],
                      result.q_draft[0], result.accept_prob[0], result.tested[0], next_p, top_p.flatten(),
                      top_i.flatten(), torch.zeros(extra, device=logits.device)]).float()


def chain_limit_reference(result, chain: torch.Tensor, count: torch.Tensor):
    """sp_greedy_readout's cut (its `limit`): a greedy chain verification's result (batch 1) accepted no
    further than the chain's `count` real drafts; cut there, the next token is the target's argmax at that
    row, which the chain's token there matched. Returns a new result."""
    k = chain.numel()
    rows = torch.arange(k, device=chain.device)[None]  # [1, K]
    accepted = torch.minimum(result.accepted, count)  # [1]
    cut = (result.accepted > count) & (result.next_token >= 0)  # -1 (NaN) stays
    next_token = torch.where(cut, chain.index_select(0, count.clamp(max=k - 1)), result.next_token)
    return result._replace(accepted=accepted, next_token=next_token,
                           path=torch.where(rows < accepted[:, None], result.path, -1),
                           tested=result.tested & (rows < count[:, None]))


def greedy_readout(logits: torch.Tensor, draft_tokens: torch.Tensor, width: int,
                   parents: Optional[torch.Tensor] = None, limit: Optional[torch.Tensor] = None,
                   extra: int = 0, chained: bool = False) -> tuple:
    """A greedy round's verification and readout at once (batch 1): verify_tree_greedy over `parents`
    (None: a chain), a chain cut at limit [1] real drafts (chain_limit_reference), then readout at T = 1.
    logits [N+1, V], draft_tokens [N]. Returns (VerifyResult, readout values). chained: the CUDA backend's
    launch option, nothing here."""
    n = draft_tokens.numel()
    tree = chain_parents(n, draft_tokens.device) if parents is None else parents
    result = verify_tree_greedy(logits[None], draft_tokens.reshape(1, n), tree)
    if limit is not None:
        result = chain_limit_reference(result, draft_tokens, limit)
    return result, readout(logits, result, draft_tokens, 1.0, width, extra)
