"""One rank's share of a step: build the target and drafter shards, their KV caches, the Eagle3
resource manager and the slot state, then `execute(plan)` = prefill, verify (the Verifier,
workers/verifier.py), draft (the Proposer).

A plan only says "continue slot s": the slot state on the device holds what a step continues
from, so the coordinator never needs the previous step's tokens on the host, which is what lets
it keep a step in flight. Greedy steps run as CUDA graphs (the Prefiller's `greedy`,
workers/prefiller.py, the Verifier's `greedy`, the draft chain); the others process logits and
sample eagerly (the Prefiller's and the Verifier's `eager`, which replays the target pass's
graph)."""

import logging
import time

import torch

from speculative.ngram import NgramProposer
from speculative.plan import DraftSchedule, LateGrammar, StepPlan, draft_schedule
from speculative.proposer import Proposer
from speculative.resource_manager import Eagle3ResourceManager
from speculative.slot_state import SlotState
from workers.build import load_models, weight_bytes
from workers.cuda_graphs import StepGraphSet, capture_step_graphs
from workers.device import pick_device, pick_dtype
from workers.draft_grammar import DraftGrammars
from workers.kv_sizing import PoolSize, cache_rows
from workers.late_grammar import DeferredStep, write_late_grammar
from workers.layers.kv_cache import KVCache
from workers.layers.parallel import tp_rank_size
from workers.memory_profile import memory_at_start, size_pool
from workers.models import ModelConfig
from workers.models.loader import resolve_model
from workers.prefiller import Prefiller
from workers.step_costs import maybe_profile
from workers.step_io import prepare_inputs, send_back
from workers.sync_guard import no_host_sync
from workers.verifier import Verifier

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg, group=None, device: torch.device | None = None):
        self.cfg, self.group = cfg, group
        self.rank, self.tp = tp_rank_size(group)
        self.device = device or pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else self.dtype
        self.check_host_sync = False  # tests turn this on
        # -> the LateGrammar of the step under way (the worker reads it from its plan socket);
        # None in one process, where such a step waits for send_late_grammar
        self.late_grammar_source = None
        self.deferred: DeferredStep | None = None
        if self.device.type == "cuda":
            # cuDNN attention builds an execution plan on the host for every new shape (81 ms
            # each, measured on the H200), and eager forwards meet a new (batch, kv_len) every
            # few steps: they use the memory-efficient kernel. Graphs have fixed shapes and are
            # captured with cuDNN (workers/cuda_graphs.py).
            torch.backends.cuda.enable_cudnn_sdp(False)
        start = time.perf_counter()
        self.model_dir = model_dir = resolve_model(cfg.model)
        self.target_cfg = ModelConfig.from_dir(model_dir)
        self.K = cfg.k
        self.M = cfg.draft_siblings if self.K else 0  # siblings per depth in the draft tree
        self.T = 1 + self.K * (self.M + 1)  # tokens per row in the verify pass
        self.max_model_len = self.target_cfg.max_len(cfg.max_model_len)
        cache_len = cache_rows(self.max_model_len, self.K, self.M, cfg.kv_block_size)
        at_start = memory_at_start(self.device, cfg)
        self.target, self.drafter = load_models(
            cfg, self.target_cfg, model_dir, group, self.device, self.dtype, cache_len
        )
        seconds = time.perf_counter() - start
        log.info(
            "rank %d: loaded %s (drafter %s) in %.1f s", self.rank, cfg.model, cfg.drafter, seconds
        )
        self.graphs = StepGraphSet()
        size = size_pool(self, cache_len, at_start)
        self._allocate(cache_len, size)
        log.info(
            "rank %d: weights %.2f GiB on this rank; %s; Eagle3 resource manager %.1f MiB",
            self.rank,
            weight_bytes(self.target, self.drafter) / 2**30,
            self.kv.capacity(self.max_model_len),
            self.resources.nbytes / 2**20,
        )
        if cfg.cuda_graphs and self.device.type == "cuda":
            with torch.inference_mode():
                self.graphs = capture_step_graphs(self, size.graph_bytes)
        self.step_costs = maybe_profile(self)  # num_draft_tokens auto: decode steps' costs

    def _allocate(self, cache_len: int, size: PoolSize) -> None:
        cfg, tc, drafter, dev = self.cfg, self.target_cfg, self.drafter, self.device
        kv = KVCache.for_models(self.target, drafter, self.tp, size, cache_len, self.kv_dtype, dev)
        self.kv, self.num_slots, self.num_blocks = kv, kv.num_slots, kv.num_blocks
        self.block_size = kv.block_size
        self.resources = Eagle3ResourceManager(
            self.num_slots,
            max(cfg.max_num_batched_tokens, self.num_slots * self.T),
            len(self.target.aux_layer_ids) * tc.hidden_size,
            drafter.cfg.hidden_size if drafter else tc.hidden_size,
            self.dtype,
            dev,
        )
        ngram = cfg.drafter == "ngram" and self.K > 0
        looks_up = ngram or (cfg.prompt_lookup > 0 and drafter is not None)
        history_len = cache_len if looks_up else 0
        self.state = SlotState(self.num_slots, self.K, self.M, tc.vocab_size, history_len, dev)
        parts = (self.state, self.resources, self.kv)
        self.proposer = self.draft_grammars = None
        if drafter is not None:
            self.proposer = Proposer(drafter, *parts, self.K, self.M, cfg.prompt_lookup)
            self.draft_grammars = DraftGrammars(tc.vocab_size, dev, self.model_dir)
        elif ngram:
            n_range = cfg.prompt_lookup_min, cfg.prompt_lookup_max
            self.proposer = NgramProposer(self.state, self.K, *n_range)
        # n-gram drafts: one lookup, cheaper in the verify's graph than launched on its own
        whole_step = (cfg.graph_first_draft and drafter is not None) or ngram
        self.verifier = Verifier(self.target, *parts, self.proposer, self.K, self.M, whole_step)
        self.prefiller = Prefiller(self.target, *parts, self.proposer, self.K)

    # ---- the step ----

    @torch.inference_mode()
    def execute(self, plan: StepPlan):
        """Launch the step. -> its StepOutput; in one process, a step with late constrained rows
        stops after its target pass (a DeferredStep) until send_late_grammar."""
        received_at, start = time.time(), time.perf_counter()
        for slot in plan.free_slots:
            self.resources.free(slot)
        for row in plan.prefills:
            if not row.is_continued:
                self.resources.allocate(row.slot)
        self.resources.check_allocated(plan.decode_slots)
        schedule = None  # per-row K
        if plan.draft_counts is not None or plan.draft_limits is not None:
            schedule = draft_schedule(plan, self.K)
        inputs = prepare_inputs(plan, self.device, schedule)
        step = DeferredStep(plan, inputs, self._run(plan, inputs, schedule), received_at, start)
        if self.device.type == "cuda":
            step.start_event = torch.cuda.Event(enable_timing=True)
            step.start_event.record()
        if self._advance(step):
            return step.output
        if self.late_grammar_source is None:
            self.deferred = step
            return step
        self._advance(step, self.late_grammar_source())
        return step.output

    @torch.inference_mode()
    def send_late_grammar(self, late: LateGrammar) -> None:
        """In one process: the deferred step goes on, its late rows' masks now known."""
        step, self.deferred = self.deferred, None
        self._advance(step, late)

    def _advance(self, step: DeferredStep, late: LateGrammar | None = None) -> bool:
        """Run the step on (with its late masks) to its end, and start sending its results back
        (-> True), or to where it waits for late masks (-> False)."""
        plan, inputs = step.plan, step.inputs
        with no_host_sync(self.check_host_sync):
            if late is not None:
                write_late_grammar(self, plan, late)
            try:
                next(step.run)
                return False
            except StopIteration as done:
                tokens, num_emitted, logprobs, prompt = done.value
            drafts = self._drafts_for_grammar(plan, inputs) if plan.use_grammar else None
        execute_s = time.perf_counter() - step.started
        output = send_back(plan.step_id, tokens, num_emitted, execute_s, logprobs, prompt, drafts)
        output.start_event = step.start_event
        output.received_at, output.launched_at = step.received_at, time.time()
        step.output = output
        return True

    def _drafts_for_grammar(self, plan: StepPlan, inputs: dict) -> tuple[torch.Tensor, ...]:
        """The step's new drafts [rows, K] and siblings [rows, M, K]: the host's grammar follows
        them to build the next step's masks."""
        slots, K = inputs["plan_slots"], max(self.K, 0)
        return self.state.drafts[slots, :K], self.state.siblings[slots, :, :K]

    def _run(self, plan: StepPlan, inputs: dict, schedule: DraftSchedule | None):
        """The step, as a generator that returns tokens [rows, K+1], num_emitted [rows], with
        plan.num_logprobs the rows' log-probabilities (`token_logprobs`, each [rows, K+1, ...])
        and with plan.num_prompt_logprobs the prefills' prompts' ones; with late constrained
        rows it first yields once, after the target pass, for their masks."""
        self.state.allocate_for(plan)
        if plan.block_updates is not None:
            where = (inputs["block_slots"], inputs["block_index"])
            self.kv.update_tables(inputs["new_slots"], where, inputs["block_ids"])
        if plan.use_grammar:
            self.state.write_grammar(inputs)
        if self.draft_grammars is not None:  # also frees the matchers of freed slots
            self.proposer.constraint = self.draft_grammars.for_step(plan)
        parts, seeds, prompt = [], [], None
        if plan.prefills:
            *part, seed, prompt = self.prefiller.run(plan, inputs, self.graphs.prefill)
            parts.append(part)
            seeds.append(seed)
        if plan.decode_slots:
            passed = None
            if plan.late_grammar_rows:
                passed = self.verifier.pass_first(plan, inputs, self.graphs, schedule)
                yield  # the late rows' masks
            *part, seed = self.verifier.verify(plan, inputs, self.graphs, schedule, passed)
            parts.append(part)
            seeds.append(seed)
        # None: no drafter, or the whole-step graph drafted already
        seeds = [s for s in seeds if s is not None]
        if seeds:
            order = depth_rows = None  # per-row K
            if schedule is not None and schedule.chain_order is not None:
                order, depth_rows = inputs["chain_order"], schedule.depth_rows
            self.proposer.chain(seeds, plan.kv_len, self.graphs, order, depth_rows)
        if self.proposer is not None and self.proposer.constraint is not None:
            self.proposer.constraint.finish()
            self.proposer.constraint = None
        tokens, emitted, logprobs = zip(*parts)
        logprobs = [part for part in logprobs if part is not None]
        logprobs = tuple(map(torch.cat, zip(*logprobs))) if logprobs else None
        return torch.cat(tokens), torch.cat(emitted), logprobs, prompt
