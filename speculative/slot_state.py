"""Per-slot device state: what a plan's "continue slot s" continues from.

Each request slot is a row (plus a dummy row that padding points at): the pending token (emitted,
not yet run through the target), the current drafts, the target's KV length, the sampling
parameters, and, from the first step that needs them, the penalty counts, logit_bias and
min_tokens rows. Admitting a prefill writes its request's row."""

import torch

from speculative.config import MAX_LOGIT_BIAS, MAX_STOP_IDS

# SamplingParams fields kept per slot: (name, dtype, value that changes nothing)
SAMPLING_FIELDS = (
    ("temperature", torch.float32, 0.0),
    ("top_p", torch.float32, 1.0),
    ("top_k", torch.long, 0),
    ("min_p", torch.float32, 0.0),
    ("frequency_penalty", torch.float32, 0.0),
    ("presence_penalty", torch.float32, 0.0),
    ("repetition_penalty", torch.float32, 1.0),
)


class SlotState:
    def __init__(self, num_slots: int, K: int, M: int, vocab_size: int, history_len: int, device):
        n, self.device, self.vocab_size = num_slots + 1, device, vocab_size

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.last_token = zeros(n)  # [slots+1]
        self.num_computed = zeros(n)  # [slots+1] target KV length
        self.drafts = zeros(n, max(K, 1))  # [slots+1, K]
        self.siblings = zeros(n, M, max(K, 1))  # [slots+1, M, K]
        self.seeds = zeros(n)
        for name, dtype, neutral in SAMPLING_FIELDS:
            setattr(self, name, torch.full((n,), neutral, dtype=dtype, device=device))
        # penalties: [slots+1, V] each slot's output token counts, and its prompt's tokens
        self.output_counts = self.in_prompt = None
        self.bias_ids = self.bias_values = None  # [slots+1, MAX_LOGIT_BIAS] logit_bias
        # min_tokens: [slots+1] the first position at which EOS and stop tokens may be emitted,
        # and [slots+1, MAX_STOP_IDS] those tokens (-1: none)
        self.stops_from = self.stop_ids = None
        # prompt lookup: every slot's tokens by position (prompt, output, the chain's drafts)
        self.history = zeros(n, history_len) if history_len else None
        # structured outputs: [slots+1, T, ceil(V / 32)] packed bitmask of every verify node
        self.num_nodes = 1 + K * (M + 1)
        self.grammar_mask = None

    def allocate_for(self, plan) -> None:
        """The rows that only steps with penalties, logit_bias or min_tokens need, once."""
        n, V, dev = self.last_token.shape[0], self.vocab_size, self.device
        if plan.use_penalties and self.output_counts is None:
            self.output_counts = torch.zeros(n, V, dtype=torch.int32, device=dev)
            self.in_prompt = torch.zeros(n, V, dtype=torch.bool, device=dev)
        if plan.use_logit_bias and self.bias_ids is None:
            self.bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.long, device=dev)
            self.bias_values = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)
        if plan.use_min_tokens and self.stops_from is None:
            self.stops_from = torch.zeros(n, dtype=torch.long, device=dev)
            self.stop_ids = torch.full((n, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)
        if plan.use_grammar:
            self.allocate_grammar_mask()

    def allocate_grammar_mask(self) -> torch.Tensor:
        """Structured outputs' masks (all allowed), once: at the first constrained step, or
        before the CUDA graphs that read them are captured."""
        if self.grammar_mask is None:
            n, V = self.last_token.shape[0], self.vocab_size
            shape = (n, self.num_nodes, -(-V // 32))
            self.grammar_mask = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        return self.grammar_mask

    def admit(self, plan, inp: dict[str, torch.Tensor]) -> None:
        """Write the rows of the plan's prefills from their inputs (workers/step_io.py)."""
        slots = inp["prefill_slots"]
        self.seeds.index_copy_(0, slots, inp["prefill_seeds"])
        for name, _, _ in SAMPLING_FIELDS:
            getattr(self, name).index_copy_(0, slots, inp[f"prefill_{name}"])
        if plan.use_logit_bias:
            self.bias_ids.index_copy_(0, slots, inp["prefill_bias_ids"])
            self.bias_values.index_copy_(0, slots, inp["prefill_bias_values"])
        elif self.bias_values is not None:  # an earlier request's bias must not reach this one
            self.bias_values.index_fill_(0, slots, 0.0)
        if plan.use_min_tokens:
            self.stops_from.index_copy_(0, slots, inp["prefill_stops_from"])
            self.stop_ids.index_copy_(0, slots, inp["prefill_stop_ids"])
        elif self.stops_from is not None:  # nor its min_tokens
            self.stops_from.index_fill_(0, slots, 0)
        if plan.use_penalties:
            self._admit_counts(slots, inp)
        if "prefill_cached_ids" in inp and self.history is not None:
            self._record_cached(slots, inp["prefill_cached_ids"], inp["prefill_cached_lens"])

    def _admit_counts(self, slots: torch.Tensor, inp: dict[str, torch.Tensor]) -> None:
        """A prefill's ids (workers/step_io.py's penalty inputs) join its slot's prompt tokens,
        and those from the earlier output on (a resumed request's) its output counts: a first
        chunk's row starts afresh, with its cached prefix's ids; a later chunk's adds its own."""
        ids, lens = inp["penalty_ids"], inp["penalty_lens"]
        B, T = ids.shape
        columns = torch.arange(T, device=self.device)
        counted = columns < lens.unsqueeze(1)  # [B, T]
        is_output = counted & (columns >= inp["penalty_output_from"].unsqueeze(1))
        kept = (~inp["penalty_is_first"]).unsqueeze(1)  # [B, 1]: the chunks so far count
        counts = self.output_counts[slots] * kept  # [B, V]
        counts.scatter_add_(1, ids, is_output.to(counts.dtype))
        self.output_counts.index_copy_(0, slots, counts)
        in_prompt = torch.zeros(B, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt.scatter_add_(1, ids, counted.int())
        self.in_prompt.index_copy_(0, slots, (in_prompt > 0) | (self.in_prompt[slots] & kept))

    def write_grammar(self, inp: dict[str, torch.Tensor]) -> None:
        """Structured outputs: the plan's constrained slots get their masks, the others none."""
        self.clear_grammar(inp["plan_slots"])
        if inp["grammar_slots"].numel():  # none where every constrained row is late
            self.grammar_mask.index_copy_(0, inp["grammar_slots"], inp["grammar_masks"])

    def clear_grammar(self, slots: torch.Tensor) -> None:
        """No mask on these slots' rows (a step without constrained rows that reads them)."""
        self.grammar_mask.index_fill_(0, slots, -1)

    def count_outputs(self, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor):
        """Penalties: add tokens [B, T] where valid [B, T] to their slots' output counts."""
        rows = slots.unsqueeze(1).expand_as(tokens)
        counts = valid.to(self.output_counts.dtype)
        self.output_counts.index_put_((rows, tokens), counts, accumulate=True)

    def _record_cached(self, slots, cached: torch.Tensor, lens: torch.Tensor) -> None:
        """The history of a prefix-cache hit's cached ids [B, C] (positions 0..lens [B]); the
        padding past them keeps what is there (a later chunk's row holds its prompt there)."""
        positions = torch.arange(cached.shape[1], device=self.device).expand_as(cached)
        rows = slots.unsqueeze(1).expand_as(cached)
        kept = self.history[rows, positions]
        self.record(slots, positions, torch.where(positions < lens.unsqueeze(1), cached, kept))

    def record(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor):
        """With prompt lookup, history[slot, position] = token for positions and tokens [B, T]."""
        if self.history is not None:
            rows = slots.unsqueeze(1).expand_as(positions)
            end = self.history.shape[1] - 1
            self.history.index_put_((rows, positions.clamp(max=end)), tokens)

    def advance(self, slots: torch.Tensor, last_token: torch.Tensor, num_computed: torch.Tensor):
        """After a target pass: each slot's pending token [B] and KV length [B]."""
        self.last_token.index_copy_(0, slots, last_token)
        self.num_computed.index_copy_(0, slots, num_computed)
