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


def lookup(history: torch.Tensor, q: torch.Tensor, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """history [B, L] token ids by position; q [B] the position of a drafter output, whose current
    token is at q+1. -> (found [B]: the n tokens ending at q+1 also occur ending at some i <= q;
    token [B]: history[i+1] for the largest such i)."""
    L = history.shape[1]
    q = q.clamp(max=L - 2).unsqueeze(1)  # [B, 1]
    i = torch.arange(n - 1, L - 1, device=history.device)  # candidate ends, i+1 < L
    match = (i <= q) & (q + 2 - n >= 0)
    for j in range(n):  # token j of the n ending at q+1 against token j of the n ending at i
        match &= history[:, j : L - n + j] == history.gather(1, (q + 2 - n + j).clamp(min=0))
    last = torch.where(match, i, 0).amax(1, keepdim=True)  # [B, 1], 0: none
    return last[:, 0] > 0, history.gather(1, last + 1)[:, 0]
