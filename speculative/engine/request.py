"""One request's progress on the host, what each step hands back for it, and step counters.

A request's progress is counters: output tokens, verify passes and what they emitted, steps in
flight; its prefill (prompt, or prompt and output when recomputed after preemption) is computed
in chunks up to `num_prefilled`."""

from dataclasses import dataclass, field

from speculative.config import SamplingParams
from speculative.grammar import PortableGrammar, RequestGrammar
from speculative.plan import DraftGrammarRow
from speculative.reasoning_grammar import ReasoningGrammar


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
    # a stop string counts if it ends past this many characters of text: a resumed request's
    # earlier output, min_tokens' (None until then)
    stops_after: int | None = 0
    ends_with_stop_token: bool = False  # the last output token is the EOS or stop token
    num_draft_tokens: int = 0  # drafts verified per step: the request's K, at most the engine's
    is_auto_k: bool = False  # its K is each step's the engine picks, up to num_draft_tokens
    num_pending_drafts: int = 0  # the drafts its last planned step made: its next verify's
    acceptance: object = None  # auto: its DecayedAcceptance (speculative/engine/draft_tuner.py)
    # structured outputs: the grammar's state after the output, and the drafts [K] and siblings
    # [M][K] that the last step proposed (the next step's masks follow them)
    grammar: "RequestGrammar | ReasoningGrammar | None" = None
    drafts: tuple[list[int], list[list[int]]] = ([], [])
    # tokens of the grammar's output the ranks' draft grammar has been sent (None: it has none)
    num_grammar_sent: int | None = None
    blocks: list[int] = field(default_factory=list)  # its KV blocks, in position order
    block_hashes: list[int] = field(default_factory=list)  # of its full blocks, once cached
    is_preempted: bool = False  # its blocks are given back; requeued once no step holds it
    # its prefill at its (last) admission: prompt, and a resumed one's output so far; how many
    # of those tokens steps were planned for (the prefix cache's first), and computed
    prefill_ids: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    num_confirmed: int = 0
    # with params.prompt_logprobs: the prompt's tokens 1.. scored so far, chunk by chunk
    prompt_logprobs: list = field(default_factory=list)
    arrival: int = 0  # the order in which the scheduler received it

    @property
    def priority_key(self) -> tuple[int, int]:
        """The priority policy's order: lower priority values first, then earlier arrivals."""
        return self.params.priority, self.arrival

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def acceptance_length(self) -> float:
        return self.num_verify_emitted / self.num_verify_steps if self.num_verify_steps else 1.0

    def draft_grammar_row(self, is_admitted: bool) -> DraftGrammarRow | None:
        """What the ranks' copy of the grammar needs this step so that the drafts follow it: the
        grammar itself and all its output on admission (the slot's copy starts afresh), else the
        output since. None for a grammar after reasoning, whose drafts stay free."""
        if not isinstance(self.grammar, RequestGrammar):
            return None
        prior = self.params.prior_output_tokens
        followed = self.prompt_ids[len(self.prompt_ids) - prior :] + self.output_ids
        grammar = None
        if is_admitted or self.num_grammar_sent is None:
            grammar, self.num_grammar_sent = PortableGrammar(self.grammar.compiled), 0
        row = DraftGrammarRow(self.slot, followed[self.num_grammar_sent :], grammar)
        self.num_grammar_sent = len(followed)
        return row


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finish_reason: str | None
    acceptance_length: float = 1.0  # the request's mean so far
    # with params.logprobs, per new token: (its log-probability, [(id, log-probability)] of the
    # top ones)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # the prompt's tokens 1.., once
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class StepStats:
    num_rows: int = 0
    num_extra_rows: int = 0  # rows of requests that had already ended (extra pass)
    num_verify_rows: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position
    num_preemptions: int = 0

    def count_verify(self, accepted: int, limit: int) -> None:
        """A row that verified `limit` drafts and accepted the first `accepted`."""
        self.num_verify_rows += 1
        self.num_draft_proposed += limit
        self.num_draft_accepted += accepted
        for j in range(accepted):
            self.accepted_at[j] += 1


def row_logprobs(arrays: tuple | None, row: int, columns, n: int | None) -> list | None:
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
