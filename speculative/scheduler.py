"""Continuous batching on the host: requests join and leave between steps.

The scheduler is a plain state machine split into `plan()` (what the next step runs) and
`process()` (apply one step's results). Plans may run ahead of results by one step: a plan never
needs the previous step's tokens, because each worker keeps every slot's pending token and drafts
on the device. A request that ends at step i may already sit in step i+1 (the extra pass); its rows
there are dropped, and its slot is released only after the last step that used it."""

import itertools
import logging
from collections import deque

import torch

from speculative.block_manager import BlockManager, RequestBlocks
from speculative.chunked_prefill import PrefillPlanning
from speculative.config import MAX_STOP_IDS, SamplingParams
from speculative.detokenizer import decode, detokenize, find_stop
from speculative.grammar import GrammarError, Grammars, RequestGrammar, bitmask_width
from speculative.plan import StepPlan, StepResult
from speculative.request import Request, RequestError, RequestOutput, StepStats, row_logprobs

log = logging.getLogger(__name__)


def step_flags(rows: list[Request], prefills: list[Request], k: int) -> dict:
    """What a step's rows need beyond greedy decoding (StepPlan's flags): steps without a
    feature do not pay for it, and greedy steps stay graphable."""
    params = [r.params for r in rows]
    prompt_logprobs = [r.params.prompt_logprobs for r in prefills]
    return dict(
        all_greedy=all(p.is_greedy for p in params),
        use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        use_min_p=any(p.min_p > 0 for p in params),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        use_penalties=any(
            p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1 for p in params
        ),
        use_logit_bias=any(p.logit_bias for p in params),
        use_min_tokens=any(r.params.min_tokens > len(r.output_ids) for r in rows),
        use_draft_limits=any(r.num_draft_tokens < k for r in rows),
        num_prompt_logprobs=max((n for n in prompt_logprobs if n is not None), default=None),
    )


class Scheduler(PrefillPlanning):
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
    ):
        self.num_slots, self.max_model_len, self.k = num_slots, max_model_len, k
        # KV rows a verify pass writes past the chain (the draft tree's siblings)
        self.tree_rows = tree_rows
        # prompt ids are checked against it (a bad id would fail the whole step)
        self.vocab_size = vocab_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.free_slots = list(range(num_slots))
        self.slots_to_release: list[int] = []  # free on the host, to be freed on the workers
        self.step_ids = itertools.count()
        self.seeds = itertools.count(seed * 1_000_003 + 1)
        self.stats = StepStats(accepted_at=[0] * k)
        self.rows_of_step: dict[int, list[str]] = {}  # request id of each result row, per step
        # the paged KV pool's blocks; None: plans over the workers' contiguous per-slot caches
        self.kv = RequestBlocks(blocks, k, tree_rows, max_model_len) if blocks else None
        self.grammars: Grammars | None = None  # compiles structured outputs' constraints

    # ---- admission ----

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request cannot be served; changes nothing."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum sequence length of {self.max_model_len} tokens"
            )
        for what, ids in (
            (
                ("prompt", prompt_ids),
                ("logit_bias", params.logit_bias),
                ("stop_token_ids", params.stop_token_ids),
            )
            if self.vocab_size
            else ()
        ):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"{what} token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
        if (
            params.min_tokens
            and len(self.eos_token_ids | set(params.stop_token_ids)) > MAX_STOP_IDS
        ):
            raise RequestError(f"min_tokens holds back at most {MAX_STOP_IDS} EOS and stop tokens")
        if (params.num_draft_tokens or 0) > self.k:
            raise RequestError(
                f"speculative.num_draft_tokens ({params.num_draft_tokens}) exceeds this server's "
                f"{self.k} draft tokens per step"
            )
        if params.prior_output_tokens > len(prompt_ids):
            raise RequestError("prior_output_tokens exceeds the prompt")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer and this model directory has none")
        if self.kv is not None and not self.kv.fits_ever(len(prompt_ids) + params.max_tokens):
            pool = self.kv.manager
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) can never "
                f"fit the KV cache pool of {pool.num_blocks} blocks x {pool.block_size} tokens"
            )
        self._check_budget(prompt_ids, params)
        if params.structured is not None:
            self._grammar_for(params)

    # ---- structured outputs (speculative/grammar.py) ----

    def _grammar_for(self, params: SamplingParams) -> RequestGrammar:
        """A new matcher of the request's grammar (compiled once, cached); RequestError naming
        what does not compile."""
        if self.grammars is None:
            if self.tokenizer is None or not self.vocab_size:
                raise RequestError("structured outputs need the model's tokenizer")
            self.grammars = Grammars.for_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        try:
            return self.grammars.matcher(params.structured)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def _add_grammar_masks(self, plan: StepPlan, rows: list[Request]) -> None:
        """The mask rows of the plan's constrained rows, after their output and drafts."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return
        T = 1 + self.k + self.tree_rows
        masks = torch.empty(
            len(constrained), T, bitmask_width(self.grammars.vocab_size), dtype=torch.int32
        )
        for i, row in enumerate(constrained):
            rows[row].grammar.fill(masks[i], *rows[row].drafts)
        plan.grammar_rows, plan.grammar_masks = constrained, masks.numpy()

    def _follow_grammar(self, r: Request, tokens: list[int], result: StepResult, row: int):
        if not r.grammar.accept(tokens):  # cannot happen: the mask allowed every token
            log.error("request %s: output left its grammar", r.request_id)
            self._finish(r, "abort")
        if result.drafts is not None:
            siblings = result.siblings[row].tolist() if result.siblings is not None else []
            r.drafts = (result.drafts[row].tolist(), siblings)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        self.validate(request_id, prompt_ids, params)
        if self.in_use(request_id):
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else next(self.seeds)
        request = Request(
            request_id, list(prompt_ids), params, seed, stops_after=None if params.min_tokens else 0
        )
        k = params.num_draft_tokens
        request.num_draft_tokens = self.k if k is None else k
        if params.structured is not None:
            request.grammar = self._grammar_for(params)
            prior = prompt_ids[len(prompt_ids) - params.prior_output_tokens :]
            if params.prior_output_tokens and not request.grammar.accept(prior):
                raise RequestError("the resumed request's earlier output does not fit its grammar")
        if params.prior_output_tokens and self.tokenizer is not None:
            # a resumed request's text goes on from its earlier output's: a stop string may span
            # the two, and what the failed engine held back (a possible stop string's start) is
            # sent from here
            request.text = decode(self.tokenizer, request)
            request.num_sent = min(params.prior_text_sent, len(request.text))
            request.read_offset = params.prior_output_tokens
            if request.stops_after == 0:  # the failed engine checked that text, with its min_tokens
                request.stops_after = len(request.text)
        self.waiting.append(request)
        return request

    def in_use(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def abort(self, request_id: str) -> None:
        for r in self.waiting:
            if r.request_id == request_id:
                r.finish_reason = "abort"
                self.waiting.remove(r)
                return
        request = self.running.get(request_id)
        if request is not None and not request.is_finished:
            self._finish(request, "abort")

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
        """vLLM's scheduler metrics, by their names (deployments/metrics.py adds our prefix);
        prefix-cache queries and hits count tokens, usage is the fraction of blocks in use."""
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

    def _will_surely_finish(self, r: Request) -> bool:
        """Each in-flight step emits at least one token: if that already reaches the limit, the
        request is done and must not be scheduled again."""
        return len(r.output_ids) + r.in_flight >= r.params.max_tokens

    def plan(self) -> StepPlan | None:
        step_id = next(self.step_ids)
        decodes, chunks, budget, updates = self._continue_running()
        prefills = [self.running[i] for i in chunks]
        num_continued = len(prefills)
        while self.waiting and self.free_slots and len(prefills) + len(decodes) < self.num_slots:
            r = self.waiting[0]
            end = self._admit(r, chunks, budget, updates)
            if end is None:
                break
            self.waiting.popleft()
            self.running[r.request_id] = r
            prefills.append(r)
            chunks[r.request_id] = end
        if not prefills and not decodes:
            return None
        prefill_rows = [
            self._prefill_row(r, chunks[r.request_id], i < num_continued)
            for i, r in enumerate(prefills)
        ]
        return self._make_plan(step_id, prefill_rows, prefills, decodes, updates)

    def _make_plan(self, step_id, prefill_rows, prefills, decodes, updates) -> StepPlan:
        rows = prefills + decodes
        for r in rows:
            r.in_flight += 1
            r.last_step = step_id
        # the KV rows any row may read: its tokens, the steps in flight, this step's drafts
        ahead = self.k + 1 + self.tree_rows
        span = max(
            len(r.prompt_ids) + len(r.output_ids) + r.in_flight * (self.k + 1) + ahead for r in rows
        )
        plan = StepPlan(
            step_id=step_id,
            prefills=prefill_rows,
            decode_slots=[r.slot for r in decodes],
            free_slots=self.slots_to_release,
            kv_len=-(-span // 64) * 64,
            **step_flags(rows, prefills, self.k),
        )
        plan.block_updates = updates
        self._add_grammar_masks(plan, rows)
        self.slots_to_release = []
        self.rows_of_step[step_id] = [r.request_id for r in rows]
        return plan

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

    # ---- results ----

    def process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        assert result.step_id == plan.step_id == min(self.rows_of_step), (
            "results must come in plan order"
        )
        outputs = []
        num_prefills = len(plan.prefills)
        for row, request_id in enumerate(self.rows_of_step.pop(plan.step_id)):
            r = self.running[request_id]
            r.in_flight -= 1
            self.stats.num_rows += 1
            if r.is_finished:
                self.stats.num_extra_rows += 1
            elif row < num_prefills and plan.prefills[row].next_token >= 0:
                # a prefill chunk short of the end: computed, nothing emitted
                p = plan.prefills[row]
                r.num_confirmed = p.start + len(p.token_ids)
            else:
                if row < num_prefills:
                    r.num_confirmed = len(r.prefill_ids)
                emitted = int(result.num_emitted[row])
                if row >= num_prefills:
                    self._count_acceptance(r, emitted)
                logprobs = row_logprobs(
                    (result.logprobs, result.top_ids, result.top_logprobs),
                    row,
                    range(emitted),
                    r.params.logprobs,
                )
                outputs.append(self._append(r, result.tokens[row, :emitted].tolist(), logprobs))
                if r.grammar is not None:
                    self._follow_grammar(r, outputs[-1].new_token_ids, result, row)
                if row < num_prefills and not plan.prefills[row].num_resumed:
                    outputs[-1].prompt_logprobs = row_logprobs(
                        result.prompt_logprobs,
                        row,
                        range(1, len(r.prompt_ids)),
                        r.params.prompt_logprobs,
                    )
            if (
                r.is_finished and r.in_flight == 0 and r.slot is not None
            ):  # _finish may have released it
                self._release(r)
            elif r.is_preempted and r.in_flight == 0:
                self._requeue(r)
            elif self.kv is not None and not r.is_finished:
                self.kv.confirm(r)
        return outputs

    def _count_acceptance(self, r: Request, emitted: int) -> None:
        """Only drafts that were verified count: none for a request that speculates with K=0,
        its own K for one that lowered it."""
        if not r.num_draft_tokens:
            return
        r.num_verify_steps += 1
        r.num_verify_emitted += emitted
        self.stats.num_verify_rows += 1
        self.stats.num_draft_proposed += r.num_draft_tokens
        self.stats.num_draft_accepted += emitted - 1
        for j in range(emitted - 1):
            self.stats.accepted_at[j] += 1

    def _append(self, r: Request, tokens: list[int], logprobs: list | None = None) -> RequestOutput:
        new = []
        for token in tokens:
            if len(r.output_ids) >= r.params.max_tokens:
                break
            r.output_ids.append(token)
            new.append(token)
            if (
                token in self.eos_token_ids
                and not r.params.ignore_eos
                or token in r.params.stop_token_ids
            ):
                # a generated token (its id, log-probability, usage) with no text, as in vLLM:
                # harnesses read the continuation's log-probabilities as all but the last token's
                r.ends_with_stop_token = True
                self._finish(r, "stop")
                break
            if r.params.stop and r.stops_after is None and len(r.output_ids) == r.params.min_tokens:
                r.stops_after = len(decode(self.tokenizer, r))
            # token by token, so the output ends where plain decoding (one token a step) ends it
            if r.params.stop and find_stop(r, decode(self.tokenizer, r)) is not None:
                self._finish(r, "stop")
                break
        if not r.is_finished and len(r.output_ids) >= r.params.max_tokens:
            self._finish(r, "length")
        # a finished request may still hold back text that could have begun a stop string
        delta = ""
        if self.tokenizer is not None and (new or r.is_finished):
            delta = detokenize(self.tokenizer, r)
        return RequestOutput(
            r.request_id,
            new,
            delta,
            r.finish_reason,
            r.acceptance_length,
            logprobs[: len(new)] if logprobs is not None else None,
        )

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
