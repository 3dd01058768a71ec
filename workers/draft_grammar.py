"""Drafts that follow the grammar: each rank keeps a matcher per constrained slot (the grammar
after the output, as the plans tell it: speculative.plan.DraftGrammarRow), and in a step with
such rows the draft chain proposes, at every depth, only tokens the grammar allows there.

The matcher is advanced along the step's emitted tokens and each depth's draft, then rolled back
once the chain is drafted, so it stays the engine's. The allowed set at a depth is the grammar's
bitmask after the drafts before it, applied to the drafter's scores (its siblings share it); where
the grammar forces the next text (xgrammar's jump-forward tokens, or one token allowed: the stop
token at the end), that token is the draft, whatever the drafter scores. Following the drafts
needs each depth's draft on the host before the next depth's mask: one synchronisation per depth,
only in steps with such rows (`host_s` sums their host time, waits included). Drafts never change
the output, which verification's own masks decide (speculative/grammar.py)."""

import logging
import time

import numpy as np
import torch
import xgrammar as xgr

from speculative.grammar import bitmask_width
from speculative.plan import StepPlan
from workers.sync_guard import allow_host_sync

log = logging.getLogger(__name__)


class DraftGrammars:
    """One rank's matchers, by slot, across steps."""

    def __init__(self, vocab_size: int, device: torch.device, model_dir=None):
        self.vocab_size, self.device, self.model_dir = vocab_size, device, model_dir
        self.width = bitmask_width(vocab_size)
        self.matchers: dict[int, xgr.GrammarMatcher] = {}
        self.infos: dict[tuple, xgr.TokenizerInfo] = {}  # by stop ids, built once
        self.host_s, self.num_steps = 0.0, 0  # steps with constrained drafts, their host time

    def for_step(self, plan: StepPlan) -> "StepGrammars | None":
        """Follow the plan's news (freed and re-admitted slots, new output); -> the step's
        constraint for the Proposer, None where no row of it has a matcher."""
        for slot in plan.free_slots:
            self.matchers.pop(slot, None)
        for row in plan.prefills:
            if not row.is_continued:
                self.matchers.pop(row.slot, None)
        self.follow(plan.draft_grammars)
        if not any(s in self.matchers for s in plan.slots):
            return None
        self.num_steps += 1
        return StepGrammars(self)

    def follow(self, rows: list) -> None:
        """Follow the output of these rows (DraftGrammarRow: the plan's, or a late one's)."""
        for row in rows:
            self._follow(row)

    def _follow(self, row) -> None:
        if row.grammar is not None:
            try:
                compiled = row.grammar.resolve(self._info)
            except (RuntimeError, ValueError) as e:  # a tokenizer unlike the engine's
                log.warning("drafts left unconstrained: the grammar does not load here (%s)", e)
                return
            self.matchers[row.slot] = xgr.GrammarMatcher(compiled)
        matcher = self.matchers.get(row.slot)
        if matcher is not None and not all(matcher.accept_token(t) for t in row.tokens):
            del self.matchers[row.slot]  # cannot happen: the engine's grammar accepted them

    def _info(self, stop_ids: tuple) -> xgr.TokenizerInfo:
        if stop_ids not in self.infos:
            from workers.models.loader import load_tokenizer

            self.infos[stop_ids] = xgr.TokenizerInfo.from_huggingface(
                load_tokenizer(self.model_dir),
                vocab_size=self.vocab_size,
                stop_token_ids=list(stop_ids),
            )
        return self.infos[stop_ids]


class StepGrammars:
    """One step's constraint on the draft chain (Proposer.constraint). The chain's batch is the
    prefills' rows then the verified ones (Proposer.chain); each `start` adds one group."""

    def __init__(self, grammars: DraftGrammars):
        self.grammars = grammars
        self.rows: list[xgr.GrammarMatcher | None] = []  # the chain's rows, in batch order
        self.group: list[xgr.GrammarMatcher | None] = []  # the group drafting its first token
        # id(matcher) -> (the matcher, tokens to roll back): also those `keep` dropped since
        self.followed: dict[int, tuple[xgr.GrammarMatcher, int]] = {}
        self.is_lost: set[int] = set()  # matchers whose drafts left the grammar this step

    def start(self, slots: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor) -> None:
        """A group's rows (slots [B]) emitted tokens [B, n] (the first emitted [B] of each):
        follow them before its first drafts."""
        began = time.perf_counter()
        with allow_host_sync():
            slots, tokens, emitted = slots.tolist(), tokens.tolist(), emitted.tolist()
        matchers = self.grammars.matchers
        self.group = [matchers.get(s) for s in slots]
        self.rows += self.group
        for m, row, n in zip(self.group, tokens, emitted):
            if m is not None:
                for token in row[:n]:
                    self._accept(m, token)
        self.grammars.host_s += time.perf_counter() - began

    def keep(self, rows) -> None:
        """The chain goes on with these of its rows (indices, a list or a device tensor), in this
        order: per-row K drops rows by depth (Proposer.chain)."""
        if isinstance(rows, torch.Tensor):
            with allow_host_sync():
                rows = rows.tolist()
        self.rows = [self.rows[i] for i in rows]

    def allowed(self, depth: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' masks at `depth` -> (packed bitmask [B, W] int32, the forced token [B] or
        -1), on the device; None where no row is constrained."""
        began = time.perf_counter()
        rows = self.group if depth == 0 else self.rows
        if all(m is None for m in rows):
            return None
        masks = np.full((len(rows), self.grammars.width), -1, dtype=np.int32)
        forced = np.full(len(rows), -1, dtype=np.int64)
        filled = torch.from_numpy(masks)  # the same memory
        for i, m in enumerate(rows):
            if m is None or id(m) in self.is_lost or m.is_terminated():
                continue
            m.fill_next_token_bitmask(filled, i)
            forced[i] = _forced(m, masks[i])
        dev = self.grammars.device
        with allow_host_sync():  # copies from pageable host memory
            out = filled.to(dev), torch.from_numpy(forced).to(dev)
        self.grammars.host_s += time.perf_counter() - began
        return out

    def follow(self, depth: int, drafts: torch.Tensor) -> None:
        """The drafts [B] at `depth`: the constrained rows' matchers follow them."""
        began = time.perf_counter()
        rows = self.group if depth == 0 else self.rows
        if any(m is not None for m in rows):
            with allow_host_sync():
                drafts = drafts.tolist()
            for m, token in zip(rows, drafts):
                if m is not None and id(m) not in self.is_lost and not m.is_terminated():
                    self._accept(m, token)
        self.grammars.host_s += time.perf_counter() - began

    def _accept(self, m: xgr.GrammarMatcher, token: int) -> None:
        if m.accept_token(token):
            self.followed[id(m)] = (m, self.followed.get(id(m), (m, 0))[1] + 1)
        else:  # a draft of a token the drafter cannot see (masked rows all -inf): stop there
            self.is_lost.add(id(m))

    def finish(self) -> None:
        """Roll every matcher back to the output the plans told."""
        for m, count in self.followed.values():
            m.rollback(count)
        self.followed.clear()


def _forced(m: xgr.GrammarMatcher, mask: np.ndarray) -> int:
    """The token the grammar forces after m's state (mask [W] its bitmask), or -1."""
    jump = m.find_jump_forward_tokens()
    if jump:
        return jump[0]
    if np.bitwise_count(mask.view(np.uint32)).sum() == 1:
        word = int(np.flatnonzero(mask)[0])
        return 32 * word + int(mask.view(np.uint32)[word]).bit_length() - 1
    return -1
