"""Continuous batching on the host: requests join and leave between steps.

The scheduler is a plain state machine split into `plan()` (what the next step runs) and
`process()` (apply one step's results). Plans may run ahead of results by one step: a plan never
needs the previous step's tokens, because each worker keeps every slot's pending token and drafts
on the device. A request that ends at step i may already sit in step i+1 (the extra pass); its rows
there are dropped, and its slot is released only after the last step that used it."""

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from speculative.config import MAX_STOP_IDS, SamplingParams
from speculative.grammar import GrammarError, Grammars, RequestGrammar, bitmask_width
from speculative.plan import PrefillRow, StepPlan, StepResult

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request that cannot be served as asked (bad parameters, prompt too long)."""


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    num_verify_steps: int = 0  # target forwards after prefill
    num_verify_emitted: int = 0  # 1 + accepted drafts, summed over those forwards
    in_flight: int = 0  # planned steps whose results are not processed yet
    last_step: int = -1  # last step id that includes this request
    text: str = ""  # decoded output so far, a resumed one's earlier output first (stop
    # strings are searched in it)
    num_sent: int = 0  # characters of text already returned as deltas
    prefix_offset: int = 0  # text ids[prefix_offset:read_offset] (`_text_ids`) are the context for
    read_offset: int = 0  # decoding the ids from read_offset on (incremental detokenizing)
    stops_after: int | None = (
        0  # a stop string counts if it ends past this many characters of text:
    )
    # a resumed request's earlier output, min_tokens' (None until then)
    ends_with_stop_token: bool = False  # the last output token is the EOS or stop token
    # structured outputs: the grammar's state after the output, and the drafts [K] and siblings
    # [M][K] that the last step proposed (the next step's masks follow them)
    grammar: RequestGrammar | None = None
    drafts: tuple[list[int], list[list[int]]] = ([], [])

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_length(self) -> float:
        return self.num_verify_emitted / self.num_verify_steps if self.num_verify_steps else 1.0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None
    acceptance_length: float = 1.0  # the request's mean so far
    # with params.logprobs, per new token: (its log-probability, [(id, log-probability)] of the top ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = (
        None  # the prompt's tokens 1.., once
    )


@dataclass
class StepStats:
    num_rows: int = 0
    num_extra_rows: int = 0  # rows of requests that had already ended (extra pass)
    num_verify_rows: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position


def _logprobs(arrays: tuple | None, row: int, columns, n: int | None) -> list | None:
    """(log-probability, top n [(id, log-probability)]) per column of a row of StepResult's
    (chosen, top ids, top log-probabilities) arrays; None when the request asked for none."""
    if n is None:
        return None
    chosen, top_ids, top_logprobs = arrays
    return [
        (
            float(chosen[row, j]),
            list(zip(top_ids[row, j, :n].tolist(), top_logprobs[row, j, :n].tolist())),
        )
        for j in columns
    ]


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
    ):
        self.num_slots, self.max_model_len, self.k = num_slots, max_model_len, k
        self.tree_rows = (
            tree_rows  # KV rows a verify pass writes past the chain (the draft tree's siblings)
        )
        self.vocab_size = (
            vocab_size  # prompt ids are checked against it (a bad id would fail the whole step)
        )
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
        if params.prior_output_tokens > len(prompt_ids):
            raise RequestError("prior_output_tokens exceeds the prompt")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer and this model directory has none")
        if len(prompt_ids) > self.max_num_batched_tokens:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )
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
        if params.structured is not None:
            request.grammar = self._grammar_for(params)
            prior = prompt_ids[len(prompt_ids) - params.prior_output_tokens :]
            if params.prior_output_tokens and not request.grammar.accept(prior):
                raise RequestError("the resumed request's earlier output does not fit its grammar")
        if params.prior_output_tokens and self.tokenizer is not None:
            # a resumed request's text goes on from its earlier output's: a stop string may span the
            # two, and what the failed engine held back (a possible stop string's start) is sent from here
            request.text = self.tokenizer.decode(self._text_ids(request), skip_special_tokens=True)
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

    # ---- planning ----

    def _will_surely_finish(self, r: Request) -> bool:
        """Each in-flight step emits at least one token: if that already reaches the limit, the
        request is done and must not be scheduled again."""
        return len(r.output_ids) + r.in_flight >= r.params.max_tokens

    def plan(self) -> StepPlan | None:
        step_id = next(self.step_ids)
        decodes = [
            r
            for r in self.running.values()
            if not r.is_finished
            and r.slot is not None
            and not self._will_surely_finish(r)
            # a constrained request's masks follow its last step's tokens and drafts
            and not (r.grammar is not None and r.in_flight)
        ]
        prefills = []
        longest = (
            0  # prefills run padded to the longest prompt: rows x longest is what the step holds
        )
        while self.waiting and self.free_slots and len(prefills) + len(decodes) < self.num_slots:
            longest_next = max(longest, len(self.waiting[0].prompt_ids))
            if (len(prefills) + 1) * longest_next > self.max_num_batched_tokens:
                break
            r = self.waiting.popleft()
            longest = longest_next
            r.slot = self.free_slots.pop(0)
            self.running[r.request_id] = r
            prefills.append(r)
        if not prefills and not decodes:
            return None
        rows = prefills + decodes
        for r in rows:
            r.in_flight += 1
            r.last_step = step_id
        span = max(
            len(r.prompt_ids)
            + len(r.output_ids)
            + r.in_flight * (self.k + 1)
            + self.k
            + 1
            + self.tree_rows
            for r in rows
        )
        plan = StepPlan(
            step_id=step_id,
            prefills=[
                PrefillRow(r.slot, r.prompt_ids, r.seed, r.params, *self._min_tokens_stops(r))
                for r in prefills
            ],
            decode_slots=[r.slot for r in decodes],
            free_slots=self.slots_to_release,
            kv_len=-(-span // 64) * 64,
            all_greedy=all(r.params.is_greedy for r in rows),
            use_top_k_top_p=any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows),
            use_min_p=any(r.params.min_p > 0 for r in rows),
            num_logprobs=max(
                (r.params.logprobs for r in rows if r.params.logprobs is not None), default=None
            ),
            use_penalties=any(
                r.params.frequency_penalty
                or r.params.presence_penalty
                or r.params.repetition_penalty != 1
                for r in rows
            ),
            use_logit_bias=any(r.params.logit_bias for r in rows),
            use_min_tokens=any(r.params.min_tokens > len(r.output_ids) for r in rows),
            num_prompt_logprobs=max(
                (
                    r.params.prompt_logprobs
                    for r in prefills
                    if r.params.prompt_logprobs is not None
                ),
                default=None,
            ),
        )
        self._add_grammar_masks(plan, rows)
        self.slots_to_release = []
        self.rows_of_step[step_id] = [r.request_id for r in rows]
        return plan

    def _min_tokens_stops(self, r: Request) -> tuple[int, list[int]]:
        """(the first position at which EOS and stop tokens may be emitted, those tokens) for min_tokens,
        which counts the tokens this request generates, as max_tokens does (a resumed one's are left)."""
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
            else:
                emitted = int(result.num_emitted[row])
                if row >= num_prefills:
                    self._count_acceptance(r, emitted)
                logprobs = _logprobs(
                    (result.logprobs, result.top_ids, result.top_logprobs),
                    row,
                    range(emitted),
                    r.params.logprobs,
                )
                outputs.append(self._append(r, result.tokens[row, :emitted].tolist(), logprobs))
                if r.grammar is not None:
                    self._follow_grammar(r, outputs[-1].new_token_ids, result, row)
                if row < num_prefills:
                    outputs[-1].prompt_logprobs = _logprobs(
                        result.prompt_logprobs,
                        row,
                        range(1, len(r.prompt_ids)),
                        r.params.prompt_logprobs,
                    )
            if (
                r.is_finished and r.in_flight == 0 and r.slot is not None
            ):  # _finish may have released it
                self._release(r)
        return outputs

    def _count_acceptance(self, r: Request, emitted: int) -> None:
        r.num_verify_steps += 1
        r.num_verify_emitted += emitted
        self.stats.num_verify_rows += 1
        self.stats.num_draft_proposed += self.k
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
                r.stops_after = len(self._decode(r))
            # token by token, so the output ends where plain decoding (one token a step) ends it
            if r.params.stop and self._find_stop(r, self._decode(r)) is not None:
                self._finish(r, "stop")
                break
        if not r.is_finished and len(r.output_ids) >= r.params.max_tokens:
            self._finish(r, "length")
        # a finished request may still hold back text that could have begun a stop string
        delta = self._detokenize(r) if self.tokenizer is not None and (new or r.is_finished) else ""
        return RequestOutput(
            r.request_id,
            new,
            delta,
            r.finish_reason,
            r.acceptance_length,
            logprobs[: len(new)] if logprobs is not None else None,
        )

    @staticmethod
    def _text_ids(r: Request) -> list[int]:
        """The tokens of the request's text: its output (less a stop token), after the earlier
        output of a resumed request."""
        prior = r.params.prior_output_tokens
        output = r.output_ids[:-1] if r.ends_with_stop_token else r.output_ids
        return r.prompt_ids[len(r.prompt_ids) - prior :] + output if prior else output

    def _decode(self, r: Request) -> str:
        return self.tokenizer.decode(self._text_ids(r), skip_special_tokens=True)

    @staticmethod
    def _find_stop(r: Request, text: str) -> int | None:
        """Where the earliest stop string that ends after `r.stops_after` characters starts in the
        text, if any does (None before min_tokens tokens: vLLM's rule, a stop string must end past
        their text)."""
        if r.stops_after is None:
            return None
        hits = [
            at
            for at in (
                text.find(stop, max(0, r.stops_after - len(stop) + 1)) for stop in r.params.stop
            )
            if at >= 0
        ]
        return min(hits) if hits else None

    def _detokenize(self, r: Request) -> str:
        """The text the new tokens add, decoding only a few tokens of context before them (a whole
        re-decode each step costs ~27 us per 128 tokens, per request, on the coordinator's thread)."""
        tokens = self._text_ids(r)
        context = self.tokenizer.decode(
            tokens[r.prefix_offset : r.read_offset], skip_special_tokens=True
        )
        window = self.tokenizer.decode(tokens[r.prefix_offset :], skip_special_tokens=True)
        if (
            window.endswith("\ufffd") and not r.is_finished
        ):  # a multi-byte character not complete yet
            return ""
        if window.startswith(context):
            text = r.text + window[len(context) :]
        else:  # the context decodes differently with what follows it: decode the whole output
            text = self._decode(r)
        r.prefix_offset, r.read_offset = r.read_offset, len(tokens)
        at = self._find_stop(r, text) if r.params.stop else None
        if at is not None:
            text = text[:at]
        r.text = text
        # what may be the start of a stop string is held back until later tokens complete or refute it
        end = len(text) if r.is_finished else len(text) - self._partial_stop(r, text)
        delta = text[r.num_sent : end]
        r.num_sent = max(r.num_sent, end)
        return delta

    @staticmethod
    def _partial_stop(r: Request, text: str) -> int:
        """The length of the longest end of `text` that is the beginning of a stop string."""
        return max(
            (k for stop in r.params.stop for k in range(1, len(stop)) if text.endswith(stop[:k])),
            default=0,
        )

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        if r.in_flight == 0 and r.slot is not None:
            self._release(r)

    def _release(self, r: Request) -> None:
        self.free_slots.append(r.slot)
        self.slots_to_release.append(r.slot)
        r.slot = None
        self.running.pop(r.request_id, None)
