"""Prompt lookup inside the EAGLE-3 draft chain. Where the drafter is unsure of its next token, the
draft is the token that followed the latest earlier occurrence of the last five tokens in the
request (prompt, output, and the chain's own drafts so far). Summaries, edits and numbers taken
from the question repeat spans of the input that the one-layer drafter misses. Five tokens, not
three or four: on GSM8K, where the drafter is mostly right, shorter matches replace more right
drafts (at P=0.8 with the committed drafter, CPU: four tokens cost 0.07, five 0.05), while sum,
alpaca and qa gain as much with five as with four (BENCHMARKS.md, "Prompt lookup in the draft
chain"). Fixed shapes and device tensors only, so it runs inside the CUDA graphs; verification is
unchanged, so the output is still exactly the target's."""

import torch
import torch.nn.functional as F


def match_end(
    history: torch.Tensor, q: torch.Tensor, n: int = 5, n_min: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """history [B, L] token ids by position; q [B] the position of a drafter output, whose current
    token is at q+1. -> (found [B]: for some length m from n down to n_min (default n), the m
    tokens ending at q+1 also occur ending at some i <= q; end [B]: that i, for the largest such
    m and then the largest i)."""
    n_min = n if n_min is None else n_min
    L, dev = history.shape[1], history.device
    q = q.clamp(max=L - 2).unsqueeze(1)  # [B, 1]
    ends = torch.arange(L - 1, device=dev)  # candidate ends i, i+1 < L
    alive = ends <= q  # [B, L-1]: the j+1 tokens ending at i equal those ending at q+1
    length = torch.zeros_like(alive, dtype=torch.long)  # of the run matched back from i
    for j in range(n):  # token j back from each end
        back = F.pad(history[:, : L - 1 - j], (j, 0), value=-1)  # [B, L-1]: history[i - j]
        current = history.gather(1, (q + 1 - j).clamp(min=0))  # [B, 1]
        alive = alive & (back == current) & (q + 1 - j >= 0)
        length += alive
    best = torch.where(length >= n_min, length * L + ends, -1).amax(1)  # longest, then latest
    return best >= 0, best % L


def lookup(
    history: torch.Tensor, q: torch.Tensor, n: int = 5, n_min: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`match_end`'s (found [B], and the token after the match [B])."""
    found, end = match_end(history, q, n, n_min)
    after = (end + 1).clamp(max=history.shape[1] - 1).unsqueeze(1)
    return found, history.gather(1, after)[:, 0]
