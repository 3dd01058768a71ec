"""The messages of one step: the plan the coordinator sends to every rank, and rank 0's result.
Plain dataclasses of Python values so they travel over any channel (pickled only between our own
processes)."""

from dataclasses import dataclass, field

import numpy as np

from speculative.config import SamplingParams


@dataclass
class PrefillRow:
    slot: int
    token_ids: list[int]
    seed: int  # the request's, or one the scheduler drew for it
    params: SamplingParams
    stops_from: int = 0  # min_tokens: the first position at which EOS and stop tokens may come
    stop_ids: list[int] = field(default_factory=list)  # ... those tokens (with min_tokens only)
    # a request resumed after preemption: its earlier output, at the end of token_ids
    num_resumed: int = 0
    start: int = 0  # position of token_ids[0]: the K/V before it is cached or computed
    next_token: int = -1  # a chunk short of the prefill's end: the token after it (else -1)
    is_continued: bool = False  # a later chunk of a prefill that an earlier step began
    # penalties: the position where the earlier output in the prefill begins (a resumed
    # request's; None: there is none), and on a first chunk past a prefix-cache hit the cached
    # prefix's ids, which the step counts without computing them
    output_from: int | None = None
    cached_ids: list[int] = field(default_factory=list)


@dataclass
class DraftGrammarRow:
    """A constrained row whose drafts follow its grammar (workers/draft_grammar.py): the output
    tokens the grammar follows past those that earlier plans sent, and with the first plan of a
    slot's request the grammar (speculative.grammar.PortableGrammar)."""

    slot: int
    tokens: list[int]
    grammar: object = None


@dataclass
class LateGrammar:
    """The masks of a plan's late constrained rows (StepPlan.late_grammar_rows), sent once the
    step before it is processed: the rows (indices into the plan's slots), their bitmasks
    [rows, T, ceil(V / 32)] int32 and the rows whose drafts follow the grammar."""

    step_id: int
    rows: list[int]
    masks: np.ndarray
    draft_grammars: list[DraftGrammarRow]


@dataclass
class StepPlan:
    step_id: int
    prefills: list[PrefillRow] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)  # "continue the request in slot s"
    free_slots: list[int] = field(default_factory=list)  # released before this step runs
    kv_len: int = 0  # cache rows any row may read
    all_greedy: bool = True
    use_top_k_top_p: bool = False
    use_min_p: bool = False
    # some row wants log-probabilities, with this many top tokens at most
    num_logprobs: int | None = None
    use_penalties: bool = False  # some row has a frequency, presence or repetition penalty
    use_logit_bias: bool = False  # some row has a logit_bias
    use_min_tokens: bool = False  # some row may still be short of its min_tokens
    num_prompt_logprobs: int | None = None  # some prefill wants its prompt's log-probabilities
    # the paged KV pool's block-table changes, (slot, index, block) each, applied after the
    # prefills' rows are reset; None: a hand-built plan over the contiguous per-slot layout
    block_updates: list[tuple[int, int, int]] | None = None
    # per-row K (speculative/draft_length.py): the drafts each row of `slots` makes this step,
    # and the drafts each decode row's verify checks (those its previous step made); None: the
    # engine's K for every row (the verify and chain graphs' form; the others replay
    # verify_by_width and draft_depth)
    draft_counts: list[int] | None = None
    draft_limits: list[int] | None = None
    # structured outputs: the constrained rows (indices into `slots`) and their packed bitmasks
    # [len(grammar_rows), T, ceil(V / 32)] int32, one row per verify node (speculative/grammar.py)
    grammar_rows: list[int] = field(default_factory=list)
    grammar_masks: np.ndarray | None = None
    draft_grammars: list[DraftGrammarRow] = field(default_factory=list)
    # constrained decode rows whose last step is still in flight: their masks follow its tokens
    # and drafts, so they come after the plan (LateGrammar), while the target pass runs
    late_grammar_rows: list[int] = field(default_factory=list)

    @property
    def graphable(self) -> bool:
        """`greedy_graphable`, every row drafting K and none constrained: the form of the verify
        and whole-step graphs and of greedy prefill's."""
        return (
            self.greedy_graphable
            and self.draft_counts is None
            and not self.use_draft_limits
            and not self.use_grammar
        )

    @property
    def greedy_graphable(self) -> bool:
        """Greedy, without log-probabilities, penalties, biases or min_tokens: the verify graphs'
        form (verify_by_width's where rows have their own K or a grammar; the others replay only
        the target pass's graph and verify eagerly)."""
        return (
            self.all_greedy
            and self.num_logprobs is None
            and not self.use_penalties
            and not self.use_logit_bias
            and self.num_prompt_logprobs is None
            and not self.use_min_tokens
        )

    @property
    def use_draft_limits(self) -> bool:
        return self.draft_limits is not None

    @property
    def use_grammar(self) -> bool:
        return bool(self.grammar_rows or self.late_grammar_rows)

    @property
    def slots(self) -> list[int]:
        """Result rows, in order: prefills first, then decodes."""
        return [p.slot for p in self.prefills] + self.decode_slots


def step_flags(rows: list, prefills: list) -> dict:
    """What a step's rows (Requests) need beyond greedy decoding (StepPlan's flags): steps without
    a feature do not pay for it, and greedy steps stay graphable."""
    params = [r.params for r in rows]
    prompt_logprobs = [r.params.prompt_logprobs for r in prefills]
    return dict(
        all_greedy=all(p.is_greedy for p in params),
        use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        use_min_p=any(p.min_p > 0 for p in params),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        use_penalties=any(p.has_penalties for p in params),
        use_logit_bias=any(p.logit_bias for p in params),
        use_min_tokens=any(r.params.min_tokens > len(r.output_ids) for r in rows),
        num_prompt_logprobs=max((n for n in prompt_logprobs if n is not None), default=None),
    )


@dataclass
class StepResult:
    step_id: int
    tokens: np.ndarray  # [rows, K+1] emitted tokens per row; only the first num_emitted count
    num_emitted: np.ndarray  # [rows] 1 + accepted drafts (1 for prefill rows)
    execute_s: float = 0.0  # worker host time inside execute, for control-plane measurements
    device_s: float = 0.0  # GPU time from the step's first kernel to its results copy (CUDA events)
    # rank 0's wall clock (time.time()): plan received, kernels launched, results on the host
    received_at: float = 0.0
    launched_at: float = 0.0
    ready_at: float = 0.0
    # with plan.num_logprobs: each emitted token's log-probability [rows, K+1], and the most likely
    # tokens' ids and log-probabilities [rows, K+1, num_logprobs]
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # with plan.num_prompt_logprobs, per prefill row and chunk column t: the log-probability of
    # the prefill's token after it (at position start + t + 1) [prefills, T], and the top ones
    # [prefills, T, num_prompt_logprobs]; a chunk's last column scores its next_token
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # with plan.use_grammar: the drafts [rows, K] and siblings [rows, M, K] the step proposed
    drafts: np.ndarray | None = None
    siblings: np.ndarray | None = None


@dataclass
class DraftSchedule:
    """How a step with per-row K runs (`draft_schedule`), in host numbers."""

    verify_width: int  # drafts per row in the verify pass: the largest limit (K without limits)
    # the decode rows whose first draft forward runs (count > 0); None: all of them
    drafting: list[int] | None
    # the draft chain's rows (the prefills, then `drafting`) with count > 0, largest count first,
    # so that each depth's rows are a prefix; None: every row drafts K
    chain_order: list[int] | None
    depth_rows: list[int]  # [K] how many of chain_order's rows draft at depth k (from 0)


def draft_schedule(plan: StepPlan, K: int) -> DraftSchedule:
    limits, counts = plan.draft_limits, plan.draft_counts
    width = max(limits, default=0) if limits is not None else K
    if counts is None:
        return DraftSchedule(width, None, None, [])
    num_prefills = len(plan.prefills)
    decode_counts = counts[num_prefills:]
    drafting = [i for i, c in enumerate(decode_counts) if c > 0]
    chain_counts = counts[:num_prefills] + [decode_counts[i] for i in drafting]
    order = sorted(range(len(chain_counts)), key=lambda i: -chain_counts[i])
    order = [i for i in order if chain_counts[i] > 0]
    depth_rows = [sum(c > k for c in chain_counts) for k in range(K)]
    if len(drafting) == len(decode_counts):
        drafting = None
    return DraftSchedule(width, drafting, order, depth_rows)
