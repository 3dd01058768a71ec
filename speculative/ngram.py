"""Drafts without a drafter (`drafter: ngram`, vLLM's n-gram speculation, also called prompt
lookup decoding): the request's last m tokens (prompt and output), m the longest from
prompt_lookup_max down to prompt_lookup_min that occurs earlier in it, are looked up once a step;
the K drafts are the tokens that followed their latest earlier occurrence, the span repeating
with its period where it runs into the present (so "a b a b" drafts "a b a ..."). Where nothing
matches, the drafts repeat the current token (rejected as cheaply as any wrong draft;
`num_draft_tokens: auto` drafts none where drafts do not pay).

It keeps the Proposer's interface (speculative/proposer.py), so the verify pass, per-row K and
the overlap loop take it unchanged; the lookup is one pass over the slot's device history, with
fixed shapes and no host sync, so a greedy step's verify and drafts replay as one CUDA graph
(Verifier.decode_step). Drafts are deterministic, as the drafter's greedy ones are, so
verification (speculative/verify.py, q one-hot) keeps the target's output exactly. A constrained
row's drafts are not masked: the verify pass's masks cut a draft its grammar forbids."""

import torch

from speculative.prompt_lookup import match_end
from speculative.proposer import DraftSeed
from speculative.slot_state import SlotState


class NgramProposer:
    def __init__(self, state: SlotState, K: int, n_min: int, n_max: int):
        self.state, self.K, self.M = state, K, 0
        self.n_min, self.n_max = n_min, n_max
        self.constraint = None  # drafts follow no grammar

    def from_prompt(self, ids, lens, token, features, batch) -> DraftSeed:
        """After a prefill of ids [B, T] (lengths lens [B]) that chose `token` [B]: the prompt and
        the token join the history; the drafts."""
        slots, rows = batch.slots, torch.arange(ids.shape[0], device=ids.device)
        end = batch.positions[rows, lens - 1]  # the prompt's last position
        self.state.record(slots, batch.positions, ids)
        self.state.record(slots, (end + 1).unsqueeze(1), token.unsqueeze(1))
        first = self.propose(slots, end)
        return DraftSeed(slots, _no_hidden(first), end, first)

    def after_verify(self, slots, tokens, emitted, base, path, kv_len: int, T: int, only=None):
        """After a verify pass that emitted tokens [B, W] (the Verifier recorded them): the drafts
        of the rows `only` (all if None) -> (a placeholder hidden state, the first drafts [B'])."""
        if only is not None:
            slots, emitted, base = slots[only], emitted[only], base[only]
        first = self.propose(slots, base + emitted - 1)
        return _no_hidden(first), first

    def chain(self, seeds, kv_len: int, graphs=None, order=None, depth_rows=None) -> None:
        """Nothing left to draft: `propose` made all K (verification stops at a row's own K)."""

    def continue_chain(self, slots, hidden, first_draft, positions, kv_len: int) -> None:
        """As `chain`, inside the whole-step graph (Verifier.decode_step)."""

    def propose(self, slots: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The K drafts of the rows in `slots` for positions q+2 on (the current token at q+1),
        written to the slot state and recorded in the history. -> the first drafts [B]."""
        history = self.state.history[slots]
        L = history.shape[1]
        q = q.clamp(max=L - 2)
        found, end = match_end(history, q, self.n_max, self.n_min)
        period = (q + 1 - end).clamp(min=1)  # where the copied span meets the present
        j = torch.arange(self.K, device=q.device)
        at = end.unsqueeze(1) + 1 + j % period.unsqueeze(1)
        at = torch.where(found.unsqueeze(1), at, (q + 1).unsqueeze(1))
        drafts = history.gather(1, at)  # [B, K]
        self.state.drafts[slots, : self.K] = drafts
        self.state.record(slots, q.unsqueeze(1) + 2 + j, drafts)
        return drafts[:, 0]


def _no_hidden(first: torch.Tensor) -> torch.Tensor:
    """The drafter's hidden state a seed carries: none here ([B, 0])."""
    return first.new_zeros(first.shape[0], 0, dtype=torch.float32)
