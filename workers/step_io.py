"""A step's host-device traffic: its inputs built in pinned host tensors and copied to the device
together, non-blocking; its results copied back asynchronously into pinned host memory, with an
event that the rank-0 sender thread waits on (DESIGN: the overlap scheduler)."""

import time
from dataclasses import dataclass

import torch

from speculative.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from speculative.plan import DraftSchedule, StepPlan, StepResult
from speculative.slot_state import SAMPLING_FIELDS


@dataclass
class StepOutput:
    """Results on their way to the host: an async copy into (pinned) host memory plus an event."""

    step_id: int
    tokens: torch.Tensor
    num_emitted: torch.Tensor
    event: torch.cuda.Event | None
    execute_s: float
    logprobs: tuple[torch.Tensor, ...] | None = None  # (token logprobs, top ids, top logprobs)
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None  # the same over the prefills' prompts
    start_event: torch.cuda.Event | None = None
    received_at: float = 0.0
    launched_at: float = 0.0
    drafts: tuple[torch.Tensor, ...] | None = None  # structured outputs: (drafts, siblings)

    def result(self) -> StepResult:
        device_s = 0.0
        if self.event is not None:
            self.event.synchronize()
            device_s = self.start_event.elapsed_time(self.event) / 1000
        logprobs = [t.numpy() for t in self.logprobs] if self.logprobs is not None else [None] * 3
        prompt = (
            tuple(t.numpy() for t in self.prompt_logprobs)
            if self.prompt_logprobs is not None
            else None
        )
        drafts, siblings = (t.numpy() for t in self.drafts) if self.drafts else (None, None)
        return StepResult(
            self.step_id,
            self.tokens.numpy(),
            self.num_emitted.numpy(),
            self.execute_s,
            device_s,
            self.received_at,
            self.launched_at,
            time.time(),
            *logprobs,
            prompt,
            drafts,
            siblings,
        )


def prepare_inputs(
    plan: StepPlan, device: torch.device, schedule: DraftSchedule | None = None
) -> dict[str, torch.Tensor]:
    """Every input built in (pinned) host tensors, then copied together, non-blocking."""
    host = {"decode_slots": torch.tensor(plan.decode_slots, dtype=torch.long)}
    if schedule is not None:
        host |= _draft_inputs(plan, schedule)
    if plan.prefills:
        host |= _prefill_inputs(plan)
    if plan.block_updates is not None:
        new_slots = [p.slot for p in plan.prefills if not p.is_continued]
        host["new_slots"] = torch.tensor(new_slots, dtype=torch.long)
        updates = torch.tensor(plan.block_updates, dtype=torch.long).view(-1, 3)
        host["block_slots"], host["block_index"], host["block_ids"] = updates.unbind(1)
    if plan.use_grammar:
        host |= _grammar_inputs(plan)
    pin = device.type == "cuda"
    return {
        k: (v.pin_memory() if pin else v).to(device, non_blocking=True) for k, v in host.items()
    }


def _draft_inputs(plan: StepPlan, schedule: DraftSchedule) -> dict[str, torch.Tensor]:
    """Per-row K: each decode row's verify limit, the decode rows that draft, the chain's rows."""
    host = {}
    if plan.draft_limits is not None:
        host["draft_limits"] = torch.tensor(plan.draft_limits, dtype=torch.long)
    if schedule.drafting is not None:
        host["drafting_rows"] = torch.tensor(schedule.drafting, dtype=torch.long)
    if schedule.chain_order is not None:
        host["chain_order"] = torch.tensor(schedule.chain_order, dtype=torch.long)
    return host


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Lists of ids -> [len(rows), longest] long, padded with 0."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids


def _prefill_inputs(plan: StepPlan) -> dict[str, torch.Tensor]:
    rows = plan.prefills
    host = {
        "prefill_ids": _padded([p.token_ids for p in rows]),
        "prefill_lens": torch.tensor([len(p.token_ids) for p in rows]),
        "prefill_slots": torch.tensor([p.slot for p in rows]),
        "prefill_starts": torch.tensor([p.start for p in rows]),
        "prefill_next": torch.tensor([p.next_token for p in rows]),
        "prefill_seeds": torch.tensor([p.seed for p in rows]),
    }
    for name, dtype, _ in SAMPLING_FIELDS:
        host[f"prefill_{name}"] = torch.tensor([getattr(p.params, name) for p in rows], dtype=dtype)
    if plan.use_logit_bias:  # [rows, MAX_LOGIT_BIAS] ids and values, padded with token 0, bias 0
        host["prefill_bias_ids"] = torch.zeros(len(rows), MAX_LOGIT_BIAS, dtype=torch.long)
        host["prefill_bias_values"] = torch.zeros(len(rows), MAX_LOGIT_BIAS, dtype=torch.float32)
        for i, p in enumerate(rows):
            bias = p.params.logit_bias
            host["prefill_bias_ids"][i, : len(bias)] = torch.tensor(list(bias), dtype=torch.long)
            host["prefill_bias_values"][i, : len(bias)] = torch.tensor(list(bias.values()))
    if plan.use_penalties:
        host |= _penalty_inputs(rows)
    if any(p.cached_ids for p in rows):  # [rows, C] padded with 0 (SlotState.admit)
        host["prefill_cached_ids"] = _padded([p.cached_ids for p in rows])
        host["prefill_cached_lens"] = torch.tensor([len(p.cached_ids) for p in rows])
    if plan.use_min_tokens:  # [rows, MAX_STOP_IDS] padded with -1
        host["prefill_stops_from"] = torch.tensor([p.stops_from for p in rows])
        host["prefill_stop_ids"] = torch.full((len(rows), MAX_STOP_IDS), -1, dtype=torch.long)
        for i, p in enumerate(rows):
            stop_ids = torch.tensor(p.stop_ids, dtype=torch.long)
            host["prefill_stop_ids"][i, : len(p.stop_ids)] = stop_ids
    return host


def _penalty_inputs(rows: list) -> dict[str, torch.Tensor]:
    """The ids each prefill row adds to its slot's penalty counts (SlotState.admit): a first
    chunk's cached prefix (not computed) and every chunk's own tokens, padded [rows, C]; where
    the earlier output begins among them; whether the row starts the slot's counts afresh."""
    counted = [p.cached_ids + p.token_ids for p in rows]
    ids = _padded(counted)
    # the position of each row's first counted id: 0 on a first chunk, else the chunk's start
    firsts = [p.start - len(p.cached_ids) for p in rows]
    no_output = ids.shape[1]
    output_from = [
        no_output if p.output_from is None else p.output_from - first
        for p, first in zip(rows, firsts)
    ]
    return {
        "penalty_ids": ids,
        "penalty_lens": torch.tensor(list(map(len, counted))),
        "penalty_output_from": torch.tensor(output_from),
        "penalty_is_first": torch.tensor([not p.is_continued for p in rows]),
    }


def _grammar_inputs(plan: StepPlan) -> dict[str, torch.Tensor]:
    """The plan's slots, the constrained ones' and their bitmasks (SlotState.write_grammar)."""
    masks = plan.grammar_masks
    return {
        "plan_slots": torch.tensor(plan.slots, dtype=torch.long),
        "grammar_slots": torch.tensor([plan.slots[i] for i in plan.grammar_rows], dtype=torch.long),
        "grammar_masks": torch.from_numpy(masks) if masks is not None else torch.empty(0),
    }


def send_back(
    step_id: int,
    tokens: torch.Tensor,
    num_emitted: torch.Tensor,
    execute_s: float,
    logprobs: tuple[torch.Tensor, ...] | None = None,
    prompt_logprobs: tuple[torch.Tensor, ...] | None = None,
    drafts: tuple[torch.Tensor, ...] | None = None,
) -> StepOutput:
    cuda = tokens.device.type == "cuda"

    def to_host(t: torch.Tensor) -> torch.Tensor:
        if not cuda:
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    logprobs, prompt_logprobs, drafts = (
        tuple(map(to_host, x)) if x is not None else None
        for x in (logprobs, prompt_logprobs, drafts)
    )
    tokens_host, emitted_host = to_host(tokens), to_host(num_emitted)
    event = None
    if cuda:
        # blocking: the sender thread sleeps until the copy is done. A spinning wait (the default)
        # slows every kernel launch of the next step in the main thread by 3-4x (measured on the
        # H200).
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
    return StepOutput(
        step_id,
        tokens_host,
        emitted_host,
        event,
        execute_s,
        logprobs,
        prompt_logprobs,
        drafts=drafts,
    )
