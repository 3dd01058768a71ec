"""How a step's token budget (`max_num_batched_tokens`) is filled: the running requests' verify
tokens first, then prefill chunks (a prompt longer than the budget takes several steps while
running streams keep decoding), and admission of a waiting request with the prefix cache's blocks
and blocks for its first chunk. The scheduler (engine/scheduler.py) owns one planner and keeps
the queues; the planner reads its running requests and changes only the requests it plans."""

import os

from speculative.engine.request import Request, RequestError
from speculative.engine.request_blocks import RequestBlocks
from speculative.plan import PrefillRow


def late_grammar() -> bool:
    """A constrained request in flight is planned again, its masks sent late
    (Scheduler.late_grammar); EAGLESERVE_LATE_GRAMMAR=0 waits for its results instead (every
    second step), for A/B. Read when a planner is made."""
    return os.environ.get("EAGLESERVE_LATE_GRAMMAR", "1") != "0"


class PrefillPlanner:
    def __init__(
        self,
        running: dict[str, Request],
        kv: RequestBlocks | None,
        k: int,
        tree_rows: int,
        max_num_batched_tokens: int,
        eos_token_ids: set[int],
    ):
        self.running = running  # the scheduler's, in admission order (read here, never changed)
        self.kv = kv  # the paged pool's blocks; None: the workers' contiguous per-slot caches
        self.k, self.tree_rows = k, tree_rows
        self.late_grammar = late_grammar()
        # a first chunk past a prefix-cache hit carries the cached prefix's ids (the workers'
        # history needs them: prompt lookup, n-gram drafts); with penalties it always does
        self.sends_cached_ids = False
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids

    def check_budget(self, prompt_ids: list[int]) -> None:
        """Without a paged pool prefills run whole: a prompt must fit one step."""
        if self.kv is None and len(prompt_ids) > self.max_num_batched_tokens:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )

    def continue_running(self) -> tuple[list[Request], dict[str, int], int]:
        """The running requests' rows of the next step: decodes, and the chunks of prefills under
        way ({request id: chunk end}), within the step's token budget (verify tokens first).
        -> (decodes, chunks, the budget left for prefills)."""
        active = [
            r
            for r in self.running.values()
            if not r.is_finished and r.slot is not None and not r.is_preempted
        ]
        decodes = [
            r
            for r in active
            if r.num_prefilled == len(r.prefill_ids)
            and not will_surely_finish(r)
            and (self.late_grammar or r.grammar is None or not r.in_flight)
        ]
        budget = self.max_num_batched_tokens
        if self.kv is not None:
            budget -= len(decodes) * (1 + self.k + self.tree_rows)
        chunks: dict[str, int] = {}
        for r in active:  # prefills under way, oldest first
            if r.num_prefilled < len(r.prefill_ids):
                end = self._chunk_end(r, chunks, budget)
                if end is None:
                    break
                chunks[r.request_id] = end
        return decodes, chunks, budget

    def admit(self, r: Request, slot: int, chunks: dict, budget: int, updates) -> int | None:
        """The waiting request r in `slot`, with the prefix cache's blocks and blocks for its first
        chunk (updates: the step's block-table updates, None without a paged pool). -> the end of
        that chunk, or None (nothing taken)."""
        r.slot, r.prefill_ids = slot, r.prompt_ids + r.output_ids
        r.num_prefilled = r.num_confirmed = 0
        r.prompt_logprobs = []
        may_match = self.kv is not None and not scores_prompt(r)
        if may_match:
            r.num_prefilled = r.num_confirmed = self.kv.match(r, r.prefill_ids, True)
        end = self._chunk_end(r, chunks, budget)
        queried = len(r.prefill_ids) if may_match else 0
        if end is None or (updates is not None and not self.kv.admit(r, end, queried, updates)):
            if end is None and self.kv is not None:
                self.kv.manager.release(r.blocks)
                r.blocks, r.block_hashes = [], []
            r.slot = None
            return None
        return end

    def prefill_row(self, r: Request, end: int, is_continued: bool) -> PrefillRow:
        """The chunk [r.num_prefilled, end) of r's prefill, which a resumed (preempted) request's
        output so far ends; a chunk short of the end emits nothing and continues with the next
        prefill token."""
        start, stops = r.num_prefilled, self._min_tokens_stops(r)
        row = PrefillRow(r.slot, r.prefill_ids[start:end], r.seed, r.params, *stops)
        row.num_resumed, row.start = len(r.prefill_ids) - len(r.prompt_ids), start
        row.next_token = r.prefill_ids[end] if end < len(r.prefill_ids) else -1
        row.is_continued = is_continued
        row.output_from = len(r.prompt_ids) - r.params.prior_output_tokens
        if (r.params.has_penalties or self.sends_cached_ids) and not is_continued:
            row.cached_ids = r.prefill_ids[:start]
        r.num_prefilled = end
        return row

    def _chunk_end(self, r: Request, chunks: dict, budget: int) -> int | None:
        """The end of r's next prefill chunk from r.num_prefilled, as the next prefill row of a
        step whose prefill rows so far (`chunks`, padded to the longest) and it hold `budget`
        tokens; None: none fits."""
        start, num_rows = r.num_prefilled, len(chunks)
        longest = max((end - self.running[i].num_prefilled for i, end in chunks.items()), default=0)
        take = len(r.prefill_ids) - start
        if self.kv is not None:  # chunks (the contiguous per-slot caches take prefills whole)
            take = min(take, budget // (num_rows + 1))
        if take < 1 or (num_rows + 1) * max(longest, take) > budget:
            return None
        return start + take

    def _min_tokens_stops(self, r: Request) -> tuple[int, list[int]]:
        """(the first position at which EOS and stop tokens may be emitted, those tokens) for
        min_tokens, which counts the tokens this request generates, as max_tokens does (a resumed
        one's are left)."""
        if not r.params.min_tokens:
            return 0, []
        # EOS too with ignore_eos, as vLLM's
        return len(r.prompt_ids) + r.params.min_tokens, sorted(
            self.eos_token_ids | set(r.params.stop_token_ids)
        )


def scores_prompt(r: Request) -> bool:
    """Whether r's prefill must return its prompt's log-probabilities: then it skips the prefix
    cache (as vLLM does), since a cached block's K/V does not give them; once r has output
    (preempted and resumed), its prompt's were sent."""
    return r.params.prompt_logprobs is not None and not r.output_ids


def will_surely_finish(r: Request) -> bool:
    """Each in-flight step emits at least one token: if that already reaches the limit, the
    request is done and must not be scheduled again."""
    return len(r.output_ids) + r.in_flight >= r.params.max_tokens
