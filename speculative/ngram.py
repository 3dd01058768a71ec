"""Drafts without a drafter (`drafter: ngram`, vLLM's n-gram speculation, also called prompt
lookup decoding): each draft is the token that followed the latest earlier occurrence of the
request's last m tokens (prompt, output and the chain's drafts so far), m the longest from
prompt_lookup_max down to prompt_lookup_min that occurs. Each draft joins the history, so a chain
copies a whole span. Where nothing matches, the draft repeats the current token (rejected as
cheaply as any wrong draft; `num_draft_tokens: auto` drafts none where drafts do not pay).

It keeps the Proposer's interface (speculative/proposer.py), so the verify pass, per-row K, the
CUDA graphs (the chain graph replays `draft_steps`) and the overlap loop take it unchanged. Drafts
are deterministic, as the drafter's greedy ones are, so verification (speculative/verify.py, q
one-hot) keeps the target's output exactly. A constrained row's drafts are not masked: the
verify pass's masks cut a draft its grammar forbids."""

import torch

from speculative.prompt_lookup import lookup
from speculative.proposer import DraftSeed
from speculative.slot_state import SlotState


class NgramProposer:
    def __init__(self, state: SlotState, K: int, n_min: int, n_max: int):
        self.state, self.K, self.M = state, K, 0
        self.n_min, self.n_max = n_min, n_max
        self.constraint = None  # drafts follow no grammar

    def from_prompt(self, ids, lens, token, features, batch) -> DraftSeed:
        """After a prefill of ids [B, T] (lengths lens [B]) that chose `token` [B]: the prompt and
        the token join the history; the first draft."""
        slots, rows = batch.slots, torch.arange(ids.shape[0], device=ids.device)
        end = batch.positions[rows, lens - 1]  # the prompt's last position
        self.state.record(slots, batch.positions, ids)
        self.state.record(slots, (end + 1).unsqueeze(1), token.unsqueeze(1))
        first = self.propose(slots, end)
        return DraftSeed(slots, _no_hidden(first), end, first)

    def after_verify(self, slots, tokens, emitted, base, path, kv_len: int, T: int, only=None):
        """After a verify pass that emitted tokens [B, W] (the Verifier recorded them): the first
        draft of the rows `only` (all if None) -> (a placeholder hidden state, the draft [B'])."""
        if only is not None:
            slots, emitted, base = slots[only], emitted[only], base[only]
        first = self.propose(slots, base + emitted - 1)
        return _no_hidden(first), first

    def chain(self, seeds: list[DraftSeed], kv_len: int, graphs=None, order=None, depth_rows=None):
        """Drafts 2..K of the step's rows (every drafting row K of them: verification stops at a
        row's own K), replaying the `chain` graph where one fits."""
        if depth_rows is not None and not depth_rows[0]:
            return
        fields = zip(*((s.slots, s.first_draft, s.positions) for s in seeds))
        slots, draft, positions = [torch.cat(field) for field in fields]
        if order is not None:
            slots, draft, positions = slots[order], draft[order], positions[order]
        whole = graphs.chain if graphs is not None else None
        if whole is not None and whole.fits(slots.shape[0], kv_len):
            whole(slots, draft, positions, kv_len=kv_len)
        else:
            self.draft_steps(slots, draft, positions, kv_len)

    def draft_steps(self, slots, draft, positions, kv_len: int) -> tuple[torch.Tensor]:
        """Drafts 2..K (graphed as `chain`) after the first drafts [B] made at positions [B]."""
        self.state.drafts[slots, 0] = draft
        for k in range(1, self.K):
            draft = self.propose(slots, positions + k)
            self.state.drafts[slots, k] = draft
        return (draft,)

    def propose(self, slots: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The draft [B] for position q+2, the current token being at q+1; recorded there."""
        history = self.state.history[slots]
        found, copied = lookup(history, q, self.n_max, self.n_min)
        current = history.gather(1, (q + 1).clamp(max=history.shape[1] - 1).unsqueeze(1))[:, 0]
        draft = torch.where(found, copied, current)
        self.state.record(slots, (q + 2).unsqueeze(1), draft.unsqueeze(1))
        return draft


def _no_hidden(first: torch.Tensor) -> torch.Tensor:
    """The drafter's hidden state a seed carries: none here ([B, 0])."""
    return first.new_zeros(first.shape[0], 0, dtype=torch.float32)
