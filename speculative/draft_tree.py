"""The draft tree that one target pass verifies: the drafter's chain of K drafts and, at every
depth, its next M choices there as leaves, siblings of that depth's chain draft. Where the chain's
draft at depth d is rejected, a sibling may still be the target's token, and then the target's
token after the sibling comes from the same pass: one more token per such step, for no extra
drafter forward. Node 0 is the pending token, nodes 1..K the chain, node K(m+1)+d sibling m at
depth d (m from 0, d from 1). In the verify pass node i is written to KV row base+i and sees
the nodes on its path from the root; an accepted sibling's K/V is then moved to its depth's row."""

import torch


def sibling_node(K: int, m, depth):
    """Node of sibling m at 0-based depth `depth` (ints or tensors)."""
    return K * (m + 1) + depth + 1


def chain_path(B: int, K: int, device) -> torch.Tensor:
    """[B, K+1] node j at column j: the path of a chain."""
    return torch.arange(K + 1, device=device).expand(B, K + 1)


def tree_layout(K: int, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> depth of each node [T], and `sees` [T, T]: node j is node i or on its path from the
    root."""
    T = 1 + K * (M + 1)
    depth = torch.cat([torch.arange(K + 1), torch.arange(1, K + 1).repeat(M)])
    parent = torch.cat([torch.tensor([0]), torch.arange(K), torch.arange(K).repeat(M)])
    sees = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        sees[i] |= sees[parent[i]]
    return depth, sees
