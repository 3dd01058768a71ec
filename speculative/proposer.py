"""The draft chain on one rank: the drafter's first forward from the target's features, draft
forwards 2..K each launched from the previous one's device tensors, the draft tree's siblings,
and prompt lookup. Drafts land in the slot state, where the next verify pass reads them."""

from dataclasses import dataclass

import torch

from speculative.drafter import Eagle3Drafter
from speculative.prompt_lookup import lookup
from speculative.resource_manager import Eagle3ResourceManager
from speculative.slot_state import SlotState
from workers.layers.kv_cache import ForwardBatch, KVCache


@dataclass
class DraftSeed:
    """What the chain continues from, per row: slot, drafter output, its position, first draft."""

    slots: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, H]
    positions: torch.Tensor  # [B]
    first_draft: torch.Tensor  # [B]


class Proposer:
    def __init__(
        self,
        drafter: Eagle3Drafter,
        state: SlotState,
        resources: Eagle3ResourceManager,
        kv: KVCache,
        K: int,
        M: int,
        prompt_lookup: float,
    ):
        self.drafter, self.state, self.resources, self.kv = drafter, state, resources, kv
        self.K, self.M = K, M  # chain depth, siblings per depth
        self.prompt_lookup = prompt_lookup
        # a step's grammar constraint on the drafts (workers/draft_grammar.py), None: free
        self.constraint = None

    def from_prompt(self, ids, lens, token, features, batch: ForwardBatch) -> DraftSeed:
        """After a prefill of ids [B, T] (lengths lens [B]) that chose `token` [B]: the first
        draft forward over the prompt. Its input at position t: the target's feature at t and
        the token at t+1."""
        slots, rows = batch.slots, torch.arange(ids.shape[0], device=ids.device)
        draft_ids = ids.roll(-1, dims=1).index_put((rows, lens - 1), token)
        h = self.drafter(draft_ids, features, batch, from_features=True)
        last = h[rows, lens - 1]
        end = batch.positions[rows, lens - 1]  # the prompt's last position
        self.state.record(slots, batch.positions, ids)
        # after the prompt: it overwrites the padding
        self.state.record(slots, (end + 1).unsqueeze(1), token.unsqueeze(1))
        if self.constraint is not None:
            self.constraint.start(slots, token.unsqueeze(1), torch.ones_like(token))
        first = self.propose(last, slots, end)
        return DraftSeed(slots, last, end, first)

    def after_verify(self, slots, tokens, emitted, base, path, kv_len: int, T: int, only=None):
        """The first draft forward over the accepted + 1 tokens of each row (tokens [B, W],
        W = K+1 or fewer, padded past emitted [B]), fed by the target features the verify pass
        (T tokens a row) captured at the nodes of `path` [B, W]; only the rows `only` [B'] if
        given (per-row K: those that draft). -> the drafter's output at the last accepted token
        [B', H], the first draft [B']."""
        W, dev = tokens.shape[1], slots.device
        features = self.resources.feature_view(slots.shape[0], T)
        if only is not None:
            slots, tokens, emitted, base = slots[only], tokens[only], emitted[only], base[only]
            features, path = features[only], path[only]
        rows = torch.arange(slots.shape[0], device=dev)
        accepted = emitted - 1
        positions = base.unsqueeze(1) + torch.arange(W, device=dev)
        valid = torch.arange(W, device=dev) <= accepted.unsqueeze(1)
        batch = self.kv.batch(slots, positions, valid, kv_len)
        if self.M:
            features = features[rows.unsqueeze(1), path]
        h = self.drafter(tokens, features, batch, from_features=True)
        last = h[rows, accepted]
        if self.constraint is not None:
            self.constraint.start(slots, tokens, emitted)
        return last, self.propose(last, slots, base + accepted)

    def chain(self, seeds: list[DraftSeed], kv_len: int, graphs=None, order=None, depth_rows=None):
        """Draft forwards 2..K from the seeds of this step's prefills and verifies, as one batch.
        Per-row K: the chain's rows in `order` [R] (largest count first; rows drafting none left
        out), and at 0-based depth k only the first depth_rows[k] of them draft, so no row runs a
        forward past its own K. graphs: the step's StepGraphSet or None; the whole chain replays
        its `chain` graph where every row drafts K unconstrained, else each depth replays
        `draft_depth` (a constraint's masks between them), where one fits."""
        if depth_rows is not None and not depth_rows[0]:
            return
        fields = zip(*((s.slots, s.first_draft, s.positions, s.hidden) for s in seeds))
        rows = [torch.cat(field) for field in fields]
        if order is not None:
            rows = [field[order] for field in rows]
            if self.constraint is not None:
                self.constraint.keep(order)
        slots, draft, positions, hidden = rows
        self.resources.write_hidden(slots, hidden)
        whole = graphs.chain if graphs is not None else None
        if depth_rows is None and self.constraint is None:
            if whole is not None and whole.fits(slots.shape[0], kv_len):
                whole(slots, draft, positions, kv_len=kv_len)
            else:
                self.draft_steps(slots, draft, positions, kv_len)
            return
        depth_rows = depth_rows or [slots.shape[0]] * self.K
        self._chain_by_depth(slots, draft, positions, kv_len, depth_rows, graphs)

    def _chain_by_depth(self, slots, draft, positions, kv_len: int, depth_rows, graphs) -> None:
        """`chain`'s forwards one depth at a time, depth k's rows the first depth_rows[k]."""
        self.state.drafts[slots, 0] = draft
        by_depth = graphs.draft_depth if graphs is not None else None
        for k in range(1, self.K):
            n = depth_rows[k]
            if not n:
                break
            slots, draft, positions = slots[:n], draft[:n], positions[:n]
            masks = None
            if self.constraint is not None:
                self.constraint.keep(range(n))
                masks = self.constraint.allowed(k)
            depth = torch.full_like(slots, k)
            args = (slots, draft, positions + k, depth, *(masks or (None, None)))
            if by_depth is not None and by_depth.fits(n, kv_len):
                (draft,) = by_depth(*args, kv_len=kv_len)
            else:
                (draft,) = self.draft_forward(*args, kv_len=kv_len)
            if masks is not None and k + 1 < self.K:  # the next depth's mask follows it
                self.constraint.follow(k, draft)

    def draft_forward(self, slots, draft, q, depth, allowed, forced, kv_len: int) -> tuple:
        """One draft forward (graphed as `draft_depth`): each row's last draft [B] at positions
        q [B] -> its next draft [B], written at depth [B] (every row's the same) of the chain;
        among the tokens `allowed` [B, W] allows and `forced` [B] where >= 0 (both optional)."""
        one = torch.ones(slots.shape[0], 1, dtype=torch.bool, device=slots.device)
        batch = self.kv.batch(slots, q.unsqueeze(1), one, kv_len)
        hidden = self.resources.read_hidden(slots).unsqueeze(1)  # [B, 1, H]
        h = self.drafter(draft.unsqueeze(1), hidden, batch, from_features=False)[:, 0]
        self.resources.write_hidden(slots, h)
        new, others = self._choose(h, slots, q, allowed, forced)
        self.state.drafts[slots, depth] = new
        if self.M:
            self.state.siblings[slots, :, depth] = others
        return (new,)

    def continue_chain(self, slots, hidden, first_draft, positions, kv_len: int) -> None:
        """Inside the whole-step graph (Verifier.decode_step): draft forwards 2..K from the
        first draft forward's output hidden [B, H] and drafts [B] at positions [B]."""
        self.resources.write_hidden(slots, hidden)
        self.draft_steps(slots, first_draft, positions, kv_len)

    def draft_steps(self, slots, draft, positions, kv_len: int) -> tuple[torch.Tensor]:
        """Draft forwards 2..K of every row, unconstrained (graphed as `chain`), each launched
        from the previous one's tensors. slots, draft (the first draft), positions (of the drafter
        output that made it): [B]. -> the last drafts [B]."""
        self.state.drafts[slots, 0] = draft
        for k in range(1, self.K):
            (draft,) = self.draft_forward(slots, draft, positions + k, k, None, None, kv_len)
        return (draft,)

    def propose(self, h: torch.Tensor, slots, q: torch.Tensor) -> torch.Tensor:
        """The first draft [B] from the drafter's output h [B, H] at positions q [B], within the
        step's constraint (if any); with a draft tree, the drafter's next M choices become the
        first depth's siblings."""
        # a grammar's allowed tokens [B, W] and forced ones [B] (-1: none), or None
        masks = self.constraint.allowed(0) if self.constraint is not None else None
        draft, others = self._choose(h, slots, q, *(masks or (None, None)))
        if masks is not None and self.K > 1:  # the next depth's mask follows it
            self.constraint.follow(0, draft)
        if self.M:
            self.state.siblings[slots, :, 0] = others
        return draft

    def _choose(self, h, slots, q, allowed, forced) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the draft [B] and the siblings [B, M]. With prompt lookup, the looked-up token where
        the drafter's own is less likely than `prompt_lookup`, recorded at q+2 so that the chain's
        next lookups see it; a token `forced` [B] (>= 0) is the draft whatever the scores."""
        history = self.state.history
        if history is None:
            top = self.drafter.propose(h, self.M + 1, allowed)  # [B, M+1]
            draft, others = top[:, 0], top[:, 1:]
        else:
            top, probability = self.drafter.propose_scored(h, self.M + 1, allowed)
            found, copied = lookup(history[slots], q)
            copy = found & (probability[:, 0] < self.prompt_lookup)
            if allowed is not None:
                copy &= _is_allowed(allowed, copied)
            draft = torch.where(copy, copied, top[:, 0])
            # the drafter's own first among the siblings, if copied over
            others = torch.where(copy.unsqueeze(1), top[:, : self.M], top[:, 1:])
        if forced is not None:
            draft = torch.where(forced >= 0, forced, draft)
        if history is not None:
            self.state.record(slots, (q + 2).unsqueeze(1), draft.unsqueeze(1))
        return draft, others


def _is_allowed(allowed: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """allowed [B, W] packed bitmasks, tokens [B] -> whether each row's token is allowed [B]."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return ((allowed[rows, tokens >> 5] >> (tokens & 31).to(torch.int32)) & 1) == 1
