"""Continuous batching on the host: requests join and leave between steps.

The scheduler is a plain state machine split into `plan()` (what the next step runs) and
`process()` (apply one step's results). Plans may run ahead of results by one step: a plan never
needs the previous step's tokens, because each worker keeps every slot's pending token and drafts
on the device. A request that ends at step i may already sit in step i+1 (the extra pass); its rows
there are dropped, and its slot is released only after the last step that used it.

It keeps the queues and slots. Its parts: the intake checks and builds new requests (intake.py),
the prefill planner fills each step's token budget (chunked_prefill.py), and the paged pool's
bookkeeping reserves each step's blocks and picks whom to preempt (request_blocks.py), the
policy orders the waiting queue (waiting_queue.py), step_grammar.py plans constrained rows."""

import itertools
import logging

from speculative.config import SamplingParams
from speculative.engine.block_manager import BlockManager
from speculative.engine.chunked_prefill import PrefillPlanner
from speculative.engine.detokenizer import append_tokens, detokenize
from speculative.engine.draft_tuner import DraftTuner
from speculative.engine.intake import RequestIntake
from speculative.engine.request import Request, RequestError, RequestOutput, StepStats, row_logprobs
from speculative.engine.request_blocks import RequestBlocks
from speculative.engine.step_grammar import add_grammar_masks, follow_grammar, late_grammar
from speculative.engine.waiting_queue import WaitingQueue
from speculative.plan import LateGrammar, PrefillRow, StepPlan, StepResult, step_flags

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        num_slots: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        k: int,
        eos_token_ids: set[int],
        tokenizer=None,
        seed: int = 0,
        vocab_size: int | None = None,
        tree_rows: int = 0,
        blocks: BlockManager | None = None,
        policy: str = "fcfs",  # EngineConfig.scheduling_policy
        auto_k: bool = False,  # EngineConfig.num_draft_tokens "auto": requests' default
        step_costs: dict | None = None,  # the runner's profiled decode steps (draft_tuner.py)
    ):
        self.num_slots, self.max_model_len, self.k = num_slots, max_model_len, k
        # KV rows a verify pass writes past the chain (the draft tree's siblings); nodes a row
        self.tree_rows, self.num_nodes = tree_rows, 1 + k + tree_rows
        self.eos_token_ids, self.tokenizer = eos_token_ids, tokenizer  # for outputs' stops and text
        self.waiting = WaitingQueue(policy)
        self.arrivals = itertools.count()
        self.running: dict[str, Request] = {}
        self.free_slots = list(range(num_slots))
        self.slots_to_release: list[int] = []  # free on the host, to be freed on the workers
        self.step_ids = itertools.count()
        self.stats = StepStats(accepted_at=[0] * k)
        self.rows_of_step: dict[int, list[str]] = {}  # request id of each result row, per step
        # the paged KV pool's blocks; None: plans over the workers' contiguous per-slot caches
        self.kv = RequestBlocks(blocks, k, tree_rows, max_model_len, policy) if blocks else None
        self.prefill = PrefillPlanner(
            self.running, self.kv, k, tree_rows, max_num_batched_tokens, eos_token_ids
        )
        self.intake = RequestIntake(
            max_model_len, k, eos_token_ids, tokenizer, seed, vocab_size, self.kv, self.prefill
        )
        self.intake.auto_k = auto_k
        self.tuner = DraftTuner(k, step_costs)

    # ---- admission ----

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request cannot be served; changes nothing."""
        self.intake.validate(request_id, prompt_ids, params, self.waiting.policy)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        self.validate(request_id, prompt_ids, params)
        if self.in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in use")
        request = self.intake.new_request(request_id, prompt_ids, params)
        request.arrival = next(self.arrivals)
        self.waiting.add(request)
        return request

    def in_use(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def abort(self, request_id: str) -> None:
        waiting = next((r for r in self.waiting if r.request_id == request_id), None)
        if waiting is not None:
            waiting.finish_reason = "abort"
            self.waiting.remove(waiting)
        elif (r := self.running.get(request_id)) is not None and not r.is_finished:
            self._finish(r, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(not r.is_finished for r in self.running.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(not r.is_finished for r in self.running.values())

    def metrics(self) -> dict[str, float]:
        """vLLM's scheduler metrics by their names (deployments/replica_metrics.py): prefix-cache
        queries and hits count tokens, usage is the fraction of blocks in use."""
        manager = self.kv.manager if self.kv is not None else None
        return {
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "kv_cache_usage_perc": manager.usage if manager else 0.0,
            "prefix_cache_queries_total": manager.stats.num_queried_tokens if manager else 0,
            "prefix_cache_hits_total": manager.stats.num_hit_tokens if manager else 0,
            "num_preemptions_total": self.stats.num_preemptions,
        }

    # ---- planning ----

    def plan(self) -> StepPlan | None:
        step_id = next(self.step_ids)
        decodes, chunks, budget = self.prefill.continue_running()
        updates = None
        if self.kv is not None:  # blocks for those rows, preempting where the pool runs out
            decodes, chunks, updates, preempted = self.kv.reserve(self.running, decodes, chunks)
            self._preempt(preempted)
        prefills = [self.running[i] for i in chunks]
        num_continued = len(prefills)
        while self.waiting and self.free_slots and len(prefills) + len(decodes) < self.num_slots:
            r = self.waiting[0]
            end = self.prefill.admit(r, self.free_slots[0], chunks, budget, updates)
            if end is None:
                break
            self.free_slots.pop(0)
            self.waiting.popleft()
            self.running[r.request_id] = r
            prefills.append(r)
            chunks[r.request_id] = end
        if not prefills and not decodes:
            return None
        prefill_rows = [
            self.prefill.prefill_row(r, chunks[r.request_id], i < num_continued)
            for i, r in enumerate(prefills)
        ]
        return self._make_plan(step_id, prefill_rows, prefills, decodes, updates)

    def _make_plan(self, step_id, prefill_rows, prefills, decodes, updates) -> StepPlan:
        rows = prefills + decodes
        for r in rows:
            r.in_flight += 1
            r.last_step = step_id
        # the KV rows any row may read: its tokens, the steps in flight, this step's drafts
        span = max(
            len(r.prompt_ids) + len(r.output_ids) + r.in_flight * (self.k + 1) + self.num_nodes
            for r in rows
        )
        plan = StepPlan(
            step_id=step_id,
            prefills=prefill_rows,
            decode_slots=[r.slot for r in decodes],
            free_slots=self.slots_to_release,
            kv_len=-(-span // 64) * 64,
            **step_flags(rows, prefills),
        )
        plan.block_updates = updates
        if self.k:
            self.tuner.assign(plan, rows, decodes)
        self._add_grammar_masks(plan, rows)
        self.slots_to_release = []
        self.rows_of_step[step_id] = [r.request_id for r in rows]
        return plan

    def _add_grammar_masks(self, plan: StepPlan, rows: list[Request]) -> None:  # timed by name
        add_grammar_masks(plan, rows, self.num_nodes)

    def late_grammar(self, plan: StepPlan) -> LateGrammar | None:
        """Once the step before `plan` is processed: the masks of plan's late rows."""
        rows = [self.running[i] for i in self.rows_of_step[plan.step_id]]
        return late_grammar(plan, rows, self.num_nodes)

    # ---- results ----

    def process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        assert result.step_id == plan.step_id == min(self.rows_of_step), (
            "results must come in plan order"
        )
        outputs = []
        num_prefills = len(plan.prefills)
        if self.k:
            self.tuner.observe_step(plan, result)
        for row, request_id in enumerate(self.rows_of_step.pop(plan.step_id)):
            r = self.running[request_id]
            r.in_flight -= 1
            self.stats.num_rows += 1
            prefill = plan.prefills[row] if row < num_prefills else None
            if r.is_finished:
                self.stats.num_extra_rows += 1
            elif prefill is not None and prefill.next_token >= 0:
                # a prefill chunk short of the end: computed, nothing emitted
                r.num_confirmed = prefill.start + len(prefill.token_ids)
                self._score_prompt(r, row, prefill, result)
            else:
                limits = plan.draft_limits
                limit = limits[row - num_prefills] if limits and not prefill else self.k
                outputs.append(self._emit(r, row, prefill, result, limit))
            if r.is_finished or r.is_preempted:
                # once no step holds it; finished (even if preempted) it leaves, never requeued
                if r.in_flight == 0 and r.slot is not None:  # _finish may have released it
                    (self._release if r.is_finished else self._requeue)(r)
            elif self.kv is not None:
                self.kv.confirm(r)
        return outputs

    def _emit(
        self, r: Request, row: int, prefill: PrefillRow | None, result, limit: int
    ) -> RequestOutput:
        """The tokens a row emitted: a verify row's (prefill None), which verified `limit`
        drafts, or a prefill's last chunk's."""
        if prefill is not None:
            r.num_confirmed = len(r.prefill_ids)
        emitted = int(result.num_emitted[row])
        most = 1 if prefill is not None else limit + 1
        if not 0 <= emitted <= most:  # never emit a token the target did not verify
            raise RuntimeError(f"result row {row} emitted {emitted} tokens, at most {most} valid")
        if prefill is None:
            self._count_acceptance(r, emitted, limit)
        logprobs = None
        if r.params.logprobs is not None:  # no call for the many rows that want none
            arrays = (result.logprobs, result.top_ids, result.top_logprobs)
            logprobs = row_logprobs(arrays, row, range(emitted), r.params.logprobs)
        tokens = result.tokens[row, :emitted].tolist()
        new = append_tokens(r, tokens, self.eos_token_ids, self.tokenizer, self._finish)
        # a finished request may still hold back text that could have begun a stop string
        delta = ""
        if self.tokenizer is not None and (new or r.is_finished):
            delta = detokenize(self.tokenizer, r)
        logprobs = logprobs[: len(new)] if logprobs is not None else None
        output = RequestOutput(
            r.request_id, new, delta, r.finish_reason, r.acceptance_length, logprobs
        )
        if r.grammar is not None:
            self._follow_grammar(r, output.new_token_ids, result, row)
        if prefill is not None and self._score_prompt(r, row, prefill, result):
            output.prompt_logprobs = r.prompt_logprobs
        return output

    def _score_prompt(self, r: Request, row: int, prefill: PrefillRow, result) -> bool:
        """Add a chunk's prompt log-probabilities to r's: its column j scores the prompt token
        at start + j + 1 (the last chunk's last column, the first output token, is not one).
        -> whether r scores its prompt (a resumed request's were sent)."""
        if r.params.prompt_logprobs is None or prefill.num_resumed:
            return False
        num_scored = min(len(prefill.token_ids), len(r.prompt_ids) - 1 - prefill.start)
        n = r.params.prompt_logprobs
        r.prompt_logprobs += row_logprobs(result.prompt_logprobs, row, range(num_scored), n)
        return True

    def _follow_grammar(self, r: Request, tokens: list[int], result: StepResult, row: int):
        if not follow_grammar(r, tokens, result, row):  # cannot happen: the mask allowed them
            log.error("request %s: output left its grammar", r.request_id)
            self._finish(r, "abort")

    def _count_acceptance(self, r: Request, emitted: int, limit: int) -> None:
        """Only verified drafts count: none for a row that verified none (K=0)."""
        if limit:
            self.tuner.observe(r, emitted - 1, limit)
            r.num_verify_steps += 1
            r.num_verify_emitted += emitted
            self.stats.count_verify(emitted - 1, limit)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r.in_flight == 0 and r.slot is not None:
            self._release(r)

    def _release(self, r: Request) -> None:
        if self.kv is not None:
            self.kv.free(r)
        self.free_slots.append(r.slot)
        self.slots_to_release.append(r.slot)
        r.slot = None
        self.running.pop(r.request_id, None)

    def _preempt(self, preempted: list[Request]) -> None:
        """Requests that gave their blocks back queue again (fcfs: in front, oldest first) once no
        step in flight holds them (whose tokens are streamed and kept, as without preemption)."""
        self.stats.num_preemptions += len(preempted)
        for r in preempted:
            if r.in_flight == 0:
                self._requeue(r)

    def _requeue(self, r: Request) -> None:
        self._release(r)
        r.is_preempted = False
        self.waiting.put_back(r)
