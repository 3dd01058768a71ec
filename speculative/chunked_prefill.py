"""How the scheduler fills a step's token budget (`max_num_batched_tokens`): the running
requests' verify tokens first, then prefill chunks (a prompt longer than the budget takes
several steps while running streams keep decoding), admission with the prefix cache's blocks,
and, with the paged KV pool, blocks reserved per step and preemption by recompute of the newest
request when they run out. A part of `Scheduler` (speculative/scheduler.py), kept apart so the
state machine's core reads on its own."""

from speculative.config import SamplingParams
from speculative.plan import PrefillRow
from speculative.request import Request, RequestError


class PrefillPlanning:
    """Methods of Scheduler over its state: running, waiting, free_slots, kv (the block
    bookkeeping, None without a paged pool), k, tree_rows, max_num_batched_tokens."""

    def _check_budget(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """A prefill that cannot run in chunks must fit one step: with a paged pool, also when
        it is recomputed after preemption (prompt and output)."""
        probe = Request("", prompt_ids, params, 0)
        num_tokens = len(prompt_ids)
        if self._may_split(probe):
            return
        if self.kv is not None:
            num_tokens += params.max_tokens - 1
        if num_tokens > self.max_num_batched_tokens:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
                + (" with max_tokens, for penalties or prompt_logprobs" if self.kv else "")
            )

    def _continue_running(self) -> tuple:
        """The running requests' rows of the next step: decodes, and the chunks of prefills under
        way ({request id: chunk end}), within the step's token budget (verify tokens first),
        with blocks reserved for them (preempting where the pool runs out). -> (decodes, chunks,
        the budget left for prefills, block-table updates or None)."""
        active = [
            r
            for r in self.running.values()
            if not r.is_finished and r.slot is not None and not r.is_preempted
        ]
        decodes = [
            r
            for r in active
            if r.num_prefilled == len(r.prefill_ids)
            and not self._will_surely_finish(r)
            # a constrained request's masks follow its last step's tokens and drafts
            and not (r.grammar is not None and r.in_flight)
        ]
        budget = self.max_num_batched_tokens
        if self.kv is not None:
            budget -= len(decodes) * (1 + self.k + self.tree_rows)
        chunks: dict[str, int] = {}
        for r in active:  # prefills under way, oldest first
            if r.num_prefilled < len(r.prefill_ids):
                end = self._chunk_end(r, r.num_prefilled, len(chunks), chunks, budget)
                if end is None:
                    break
                chunks[r.request_id] = end
        if self.kv is None:
            return decodes, chunks, budget, None
        updates = []
        self._reserve_blocks(decodes, chunks, updates)
        decodes = [r for r in decodes if not r.is_preempted]
        chunks = {i: end for i, end in chunks.items() if not self.running[i].is_preempted}
        return decodes, chunks, budget, updates

    def _prefill_row(self, r: Request, end: int, is_continued: bool) -> PrefillRow:
        """The chunk [r.num_prefilled, end) of r's prefill, which a resumed (preempted) request's
        output so far ends; a chunk short of the end emits nothing and continues with the next
        prefill token."""
        start, stops = r.num_prefilled, self._min_tokens_stops(r)
        row = PrefillRow(r.slot, r.prefill_ids[start:end], r.seed, r.params, *stops)
        row.num_resumed, row.start = len(r.prefill_ids) - len(r.prompt_ids), start
        row.next_token = r.prefill_ids[end] if end < len(r.prefill_ids) else -1
        row.is_continued = is_continued
        row.num_draft_tokens = r.num_draft_tokens
        r.num_prefilled = end
        return row

    def _may_split(self, r: Request) -> bool:
        """Whether r's prefill may start past a cached prefix or run in chunks: penalties count,
        and prompt_logprobs score, the whole prompt at once on the workers."""
        p = r.params
        penalties = p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1
        return self.kv is not None and not penalties and p.prompt_logprobs is None

    def _chunk_end(self, r: Request, start: int, num_rows: int, chunks, budget: int) -> int | None:
        """The end of r's next prefill chunk from `start`, as prefill row num_rows + 1 of a step
        whose prefill rows (padded to the longest) hold `budget` tokens; None: none fits."""
        longest = max((end - self.running[i].num_prefilled for i, end in chunks.items()), default=0)
        take = len(r.prefill_ids) - start
        if self._may_split(r):
            take = min(take, budget // (num_rows + 1))
        if take < 1 or (num_rows + 1) * max(longest, take) > budget:
            return None
        return start + take

    def _admit(self, r: Request, chunks: dict, budget: int, updates: list | None) -> int | None:
        """A slot, the prefix cache's blocks and blocks for its first chunk for the next waiting
        request. -> the end of that chunk, or None (nothing taken)."""
        r.slot, r.prefill_ids = self.free_slots[0], r.prompt_ids + r.output_ids
        r.num_prefilled = r.num_confirmed = 0
        may_split = self._may_split(r)
        if may_split:
            r.num_prefilled = r.num_confirmed = self.kv.match(r, r.prefill_ids, True)
        end = self._chunk_end(r, r.num_prefilled, len(chunks), chunks, budget)
        queried = len(r.prefill_ids) if may_split else 0
        if end is None or (updates is not None and not self.kv.admit(r, end, queried, updates)):
            if end is None and self.kv is not None:
                self.kv.manager.release(r.blocks)
                r.blocks, r.block_hashes = [], []
            r.slot = None
            return None
        self.free_slots.pop(0)
        return end

    def _reserve_blocks(self, decodes: list[Request], chunks: dict, updates: list) -> None:
        """Blocks for the rows the next step writes, oldest request first; where the pool runs
        out, the most recently admitted running request gives its blocks back (preempted:
        recomputed from its tokens later)."""
        decode_ids = {r.request_id for r in decodes}
        for r in list(self.running.values()):
            if r.is_preempted:
                continue
            if r.request_id in decode_ids:
                missing = self.kv.missing(r, r.in_flight + 1)
            elif r.request_id in chunks:
                missing = max(0, self.kv.needed(chunks[r.request_id], 1) - len(r.blocks))
            else:
                continue
            while missing > self.kv.manager.num_free and not r.is_preempted:
                self._preempt(
                    next(
                        v for v in reversed(self.running.values()) if v.blocks and not v.is_finished
                    )
                )
            if not r.is_preempted:
                self.kv.grow(r, missing, updates)

    def _preempt(self, r: Request) -> None:
        r.is_preempted = True
        self.kv.free(r)
        self.stats.num_preemptions += 1
        if r.in_flight == 0:
            self._requeue(r)

    def _requeue(self, r: Request) -> None:
        self._release(r)
        r.is_preempted = False
        self.waiting.appendleft(r)
