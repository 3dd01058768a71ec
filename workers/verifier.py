"""One rank's verify side of a step: the target's pass over each row's draft tree (the pending
token, the K drafts, their siblings), acceptance (`speculative/verify.py`'s rules), moving an
accepted sibling's K/V into place and advancing the slots. The runner composes it, as it does the
Proposer, and passes it the step's graphs.

Greedy steps replay `greedy` (or, with `graph_first_draft`, `decode_step`: the whole step with
the first draft) as CUDA graphs, and `greedy_limited` where rows have their own K or a grammar;
the others replay `target_pass`'s graph and verify eagerly (`eager`)."""

import torch
import torch.nn.functional as F

from speculative.draft_tree import tree_layout
from speculative.plan import StepPlan
from speculative.proposer import DraftSeed, Proposer
from speculative.resource_manager import Eagle3ResourceManager
from speculative.sampling import apply_bitmask, process_logits, slot_probs, token_logprobs
from speculative.slot_state import SlotState
from speculative.verify import verify_greedy, verify_seeded
from workers.cuda_graphs import StepGraphs, StepGraphSet
from workers.layers.kv_cache import KVCache


class Verifier:
    def __init__(
        self,
        target,
        state: SlotState,
        resources: Eagle3ResourceManager,
        kv: KVCache,
        proposer: Proposer | None,
        K: int,
        M: int,
        whole_step: bool,
    ):
        self.target, self.state, self.resources, self.kv = target, state, resources, kv
        self.proposer = proposer  # None without a drafter
        self.K, self.M = K, M  # chain depth, siblings per depth
        self.whole_step = whole_step  # the verify graphs are `decode_step`'s
        self.device = state.device
        depth, sees = tree_layout(K, M)
        self.node_depth, self.tree_sees = depth.to(self.device), sees.to(self.device)
        self.T = depth.shape[0]  # tokens per row in the verify pass

    def verify(
        self, plan: StepPlan, inputs: dict, graphs: StepGraphSet, schedule=None, passed=None
    ):
        """-> tokens [B, K+1], num_emitted [B], logprobs or None, and what the draft chain
        continues from (None without a drafter, when no row drafts, or when the whole-step graph
        drafted already). With per-row K (`schedule`, a DraftSchedule) a chain's pass holds only
        the most drafts any row has, and only the rows that draft run the first draft forward.
        passed: `pass_first`'s target pass, launched before late constrained rows' masks came
        (the verification after it is eager)."""
        slots, graph, logprobs = inputs["decode_slots"], graphs.verify, None
        B, kv_len, limits = slots.shape[0], plan.kv_len, inputs.get("draft_limits")
        width = self._width(schedule)
        limited = graphs.limited_verify(width) if plan.greedy_graphable else None
        if passed is not None:
            width, out = passed
            tokens, emitted, base, path, logprobs = self.eager(
                plan, slots, kv_len, None, width, limits, out
            )
        elif graph is not None and plan.graphable and graph.fits(B, kv_len):
            tokens, emitted, base, path = graph(slots, kv_len=kv_len)
            if self.whole_step:
                return tokens, emitted, None, None
        elif limited is not None and limited.fits(B, kv_len):
            if not plan.use_grammar:  # masks left by constrained steps before
                self.state.clear_grammar(slots)
            tokens, emitted, base, path = limited(slots, limits, kv_len=kv_len)
            width = tokens.shape[1] - 1
        else:
            width = self._eager_width(B, kv_len, width, graphs)
            tokens, emitted, base, path, logprobs = self.eager(
                plan, slots, kv_len, graphs.target_pass, width, limits
            )
        padded, logprobs = self._padded(tokens, logprobs)
        if self.proposer is None or (schedule is not None and schedule.drafting == []):
            return padded, emitted, logprobs, None
        rows = inputs.get("drafting_rows")  # None: all of them
        T = self.T if width == self.K else width + 1
        last, first_draft = self.proposer.after_verify(
            slots, tokens, emitted, base, path, plan.kv_len, T, rows
        )
        ends = base + emitted - 1
        if rows is not None:
            slots, ends = slots[rows], ends[rows]
        return padded, emitted, logprobs, DraftSeed(slots, last, ends, first_draft)

    def pass_first(self, plan: StepPlan, inputs: dict, graphs: StepGraphSet, schedule=None):
        """The target pass alone, launched (from its graph where one fits) before the masks of
        late constrained rows are known. -> `verify`'s `passed`: its width, its outputs."""
        slots, kv_len = inputs["decode_slots"], plan.kv_len
        width = self._eager_width(slots.shape[0], kv_len, self._width(schedule), graphs)
        return width, self._target_pass_of(slots, kv_len, graphs.target_pass, width)

    def _target_pass_of(self, slots, kv_len: int, graphs: StepGraphs | None, width: int):
        """`target_pass`, replayed from its graphs where one fits."""
        if graphs is not None and graphs.fits(slots.shape[0], kv_len):
            return graphs(slots, kv_len=kv_len)
        return self.target_pass(slots, kv_len, width)

    def _width(self, schedule) -> int:
        """The drafts a row in this step's verify pass (a tree's always K)."""
        return self.K if schedule is None or self.M else schedule.verify_width

    def _eager_width(self, B: int, kv_len: int, width: int, graphs: StepGraphSet) -> int:
        """Padded to K where the target pass's graph fits: the limits stop acceptance."""
        target_graphs = graphs.target_pass
        return self.K if target_graphs is not None and target_graphs.fits(B, kv_len) else width

    def _padded(self, tokens: torch.Tensor, logprobs: tuple | None) -> tuple:
        """A narrower verify pass's tokens [B, w+1] and logprobs, padded to K+1 columns."""
        pad = self.K + 1 - tokens.shape[1]
        if not pad:
            return tokens, logprobs
        if logprobs is not None:
            chosen, top_ids, top_values = logprobs
            wide = (0, 0, 0, pad)
            logprobs = (F.pad(chosen, (0, pad)), F.pad(top_ids, wide), F.pad(top_values, wide))
        return F.pad(tokens, (0, pad)), logprobs

    def target_pass(self, slots: torch.Tensor, kv_len: int, width: int | None = None):
        """The target's forward over each row's draft tree (the pending token, the drafts, their
        siblings), writing its K/V and the drafter's features. -> final hidden states [B, T, H],
        the tree's tokens [B, T], the position of the pending token before the step [B]. A
        chain's pass may hold fewer drafts (`width` < K, per-row K): T = width + 1."""
        M, B, state = self.M, slots.shape[0], self.state
        K = self.K if width is None else width
        T = self.T if K == self.K else K + 1
        base = state.num_computed[slots]  # [B]
        drafts = [state.drafts[slots, :K]]
        if M:
            drafts.append(state.siblings[slots, :, :K].flatten(1))
        ids = torch.cat([state.last_token[slots].unsqueeze(1), *drafts], dim=1)  # [B, T]
        valid = torch.ones_like(ids, dtype=torch.bool)
        positions = base.unsqueeze(1) + self.node_depth[:T]  # [B, T]; a chain's: its positions
        if M:
            rows = base.unsqueeze(1) + torch.arange(self.T, device=self.device)
            batch = self.kv.batch(slots, positions, valid, kv_len, rows, self.tree_sees)
        else:
            batch = self.kv.batch(slots, positions, valid, kv_len)
        features = self.resources.feature_view(B, T) if self.proposer is not None else None
        hidden, _ = self.target(ids, batch, features)
        return hidden, ids, base

    def _split_tree(self, ids: torch.Tensor, K: int | None = None):
        """The verify pass's tokens [B, T] -> drafts [B, K], siblings [B, M, K] or None."""
        K, M = self.K if K is None else K, self.M
        siblings = ids[:, K + 1 :].reshape(ids.shape[0], M, K) if M else None
        return ids[:, 1 : K + 1], siblings

    def greedy(self, slots: torch.Tensor, kv_len: int):
        """The CUDA-graphed verify pass. -> tokens [B, K+1], num_emitted [B], position of the
        pending token before the step [B], the node whose logits chose each token [B, K+1]."""
        hidden, ids, base = self.target_pass(slots, kv_len)
        target_ids = self.target.logits(hidden).argmax(-1)
        tokens, emitted, path = verify_greedy(target_ids, *self._split_tree(ids))
        self._after_verify(slots, tokens, emitted, base, path)
        return tokens, emitted, base, path

    def greedy_limited(self, slots: torch.Tensor, limits: torch.Tensor, kv_len: int, width: int):
        """`greedy` for steps with per-row K or constrained rows (graphed as verify_by_width): a
        pass of `width` drafts a row, each row accepting at most its limits [B], with the
        grammar's masks (SlotState.grammar_mask: all allowed on unconstrained rows)."""
        hidden, ids, base = self.target_pass(slots, kv_len, width)
        logits = self.target.logits(hidden)
        masks = self.state.grammar_mask[slots, : ids.shape[1]]
        target_ids = apply_bitmask(logits, masks).argmax(-1)
        drafts, siblings = self._split_tree(ids, width)
        tokens, emitted, path = verify_greedy(target_ids, drafts, siblings, limits)
        self._after_verify(slots, tokens, emitted, base, path)
        return tokens, emitted, base, path

    def eager(
        self,
        plan: StepPlan,
        slots: torch.Tensor,
        kv_len: int,
        graphs: StepGraphs | None,
        width: int | None = None,
        limit: torch.Tensor | None = None,
        passed: tuple | None = None,
    ):
        """Verification with sampling, penalties, bias, min_tokens, logprobs or per-row K (each
        row accepting at most its `limit` [B] drafts, in a pass of `width` drafts), after the
        target pass (replayed from its graphs where one fits; `passed`: launched already).
        -> `greedy`'s outputs and the logprobs or None."""
        K, B = self.K if width is None else width, slots.shape[0]
        passed = passed or self._target_pass_of(slots, kv_len, graphs, K)
        hidden, ids, base = passed
        T = ids.shape[1]
        drafts, siblings = self._split_tree(ids, K)
        positions = base.unsqueeze(1) + self.node_depth[:T]  # [B, T] each node's position
        raw_logits = self.target.logits(hidden)  # [B, T, V]
        # node i's logits choose the token at its position + 1
        sees = self.tree_sees[:T, :T]
        logits = process_logits(plan, self.state, raw_logits, slots, positions + 1, ids, sees)
        if plan.all_greedy:
            tokens, emitted, path = verify_greedy(logits.argmax(-1), drafts, siblings, limit)
        else:
            probs = slot_probs(plan, self.state, logits, slots)
            seeds, chain = self.state.seeds[slots], positions[:, : K + 1]
            tokens, emitted, path = verify_seeded(probs, drafts, siblings, seeds, chain, limit)
        logprobs = None
        if plan.num_logprobs is not None:  # the model's own, before penalties
            rows = torch.arange(B, device=self.device).unsqueeze(1)
            logprobs = token_logprobs(raw_logits[rows, path], tokens, plan.num_logprobs)
        if plan.use_penalties:
            emitted_mask = torch.arange(K + 1, device=self.device) < emitted.unsqueeze(1)
            self.state.count_outputs(slots, tokens, emitted_mask)
        self._after_verify(slots, tokens, emitted, base, path)
        return tokens, emitted, base, path, logprobs

    def _after_verify(self, slots, tokens, emitted, base, path) -> None:
        """Move an accepted sibling's K/V into place and advance the slots."""
        rows = torch.arange(slots.shape[0], device=self.device)
        last = emitted - 1  # the last emitted token's column: its node is the only one to move
        if self.M:
            node = path[rows, last]
            into = torch.where(node != last, slots, self.kv.dummy_slot)
            self.kv.move_target_rows(slots, into, base + node, base + last)
        self.state.advance(slots, tokens[rows, last], base + emitted)
        # past the emitted ones: overwritten before being read
        width = tokens.shape[1]
        self.state.record(slots, base.unsqueeze(1) + self.node_depth[:width] + 1, tokens)

    def decode_step(self, slots: torch.Tensor, kv_len: int):
        """A whole greedy decode step as one CUDA graph (`graph_first_draft`, and always for n-gram
        drafts): verify pass, first draft forward and draft forwards 2..K (or the lookup). The
        first draft's shape is fixed at [B, K+1] (rows past the accepted tokens write to the
        dummy slot), so it can be captured, which saves its ~40 eager launches and the chain
        graph's launch and input copies."""
        tokens, emitted, base, path = self.greedy(slots, kv_len)
        last, first_draft = self.proposer.after_verify(
            slots, tokens, emitted, base, path, kv_len, self.T
        )
        self.proposer.continue_chain(slots, last, first_draft, base + emitted - 1, kv_len)
        return tokens, emitted, base, path
