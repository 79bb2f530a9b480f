"""Hand-made trace records (the JSON of RoundEvents) for the prediction and diagnosis tests."""
from __future__ import annotations

import json


def token(token_id, depth, parent, accepted, tested=True, p=0.9, top=0.9, u=None) -> dict:
    return {"token_id": token_id, "text": str(token_id), "parent": parent, "depth": depth, "p": p, "q": 1.0,
            "accept_prob": 1.0 if accepted else 0.0, "u": u, "accepted": accepted, "tested": tested,
            "top": [["t", top]]}


def chain_round(index, k, accepted, method="draft", draft_ms=1.0, verify_ms=2.0, overhead_ms=0.2,
                drafted_ids=None, next_id=1000, emitted=None, sampled=False, finish=None, p=0.9) -> dict:
    """A chain round: K drafted, the first `accepted` accepted, then a correction or bonus token."""
    ids = drafted_ids if drafted_ids is not None else [100 + d for d in range(k)]
    drafted = [token(ids[d], d, d - 1, d < accepted, tested=d <= accepted, p=p if d < accepted else 0.1,
                     u=(0.5 if sampled and d <= accepted else None)) for d in range(len(ids))]
    out = emitted if emitted is not None else ids[:accepted] + [next_id]
    return {"type": "round", "round": index, "method": method, "k": k, "drafted": drafted,
            "accepted_count": accepted, "next_token_id": out[-1], "next_token_text": "", "next_is_bonus":
            accepted == len(ids), "next_token_p": 0.9, "next_top": [["t", 0.9]], "emitted_ids": out,
            "emitted_text": "", "position": 0, "draft_ms": draft_ms, "verify_ms": verify_ms,
            "overhead_ms": overhead_ms, "finished": finish is not None, "finish_reason": finish}


def tree_round(index, parents, path, method="eagle", k=3, draft_ms=1.0, verify_ms=2.0,
               overhead_ms=0.2) -> dict:
    """A tree round: nodes with `parents`; `path` the accepted node indices (root to leaf)."""
    depths = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    on_path = set(path)
    reached = {-1} | on_path
    drafted = [token(200 + i, depths[i], parents[i], i in on_path, tested=parents[i] in reached)
               for i in range(len(parents))]
    out = [200 + i for i in path] + [1000]
    return {"round": index, "method": method, "k": k, "drafted": drafted, "accepted_count": len(path),
            "next_token_id": 1000, "next_token_text": "", "next_is_bonus": False, "next_token_p": 0.9,
            "next_top": [["t", 0.9]], "emitted_ids": out, "emitted_text": "", "position": 0,
            "draft_ms": draft_ms, "verify_ms": verify_ms, "overhead_ms": overhead_ms, "finished": False,
            "finish_reason": None}


def write_trace(path, records, header=None) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        if header is not None:
            handle.write(json.dumps({"type": "header", **header}) + "\n")
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)
