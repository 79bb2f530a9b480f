"""Token trees for drafting: merge candidate sequences into a trie in topological order."""
from __future__ import annotations

import numpy as np
import torch


def build_trie(paths: list) -> tuple[list, list]:
    """Merge token sequences into a tree. Returns (tokens, parents), parents[i] < i, -1 = root.

    Shared prefixes become one node, so no two siblings carry the same token (a duplicate sibling could
    never be accepted after its twin was rejected, and would only cost verification work)."""
    tokens: list = []
    parents: list = []
    children: dict = {}  # (parent index, token) -> node index
    for path in paths:
        parent = -1
        for token in path:
            key = (parent, int(token))
            node = children.get(key)
            if node is None:
                node = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
                children[key] = node
            parent = node
    return tokens, parents


def as_tensors(tokens: list, parents: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A host-drafted tree's tensors: tokens [N] and parents [N], both on the host (see Draft): the decoder
    uploads them with the rest of the round's inputs in one copy. Made through numpy: a third of
    torch.tensor's host time for lists this short."""
    return (torch.from_numpy(np.array(tokens, dtype=np.int64)),
            torch.from_numpy(np.array(parents, dtype=np.int64)))
