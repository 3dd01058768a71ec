"""One rank's share of a step: build the target and drafter shards, their KV caches, the Eagle3
resource manager and the slot state, then `execute(plan)` = prefill, verify, draft.

A plan only says "continue slot s": the slot state on the device holds what a step continues
from, so the coordinator never needs the previous step's tokens on the host, which is what lets
it keep a step in flight. Greedy steps run as CUDA graphs (`_prefill_greedy`, `_verify_greedy`,
the draft chain); the others replay the target pass's graph and process logits, verify and
sample eagerly (`_prefill_eager`, `_verify_eager`)."""

import logging
import time

import torch
import torch.nn.functional as F

from speculative.draft_tree import tree_layout
from speculative.plan import StepPlan
from speculative.proposer import DraftSeed, Proposer
from speculative.resource_manager import Eagle3ResourceManager
from speculative.sampling import (
    process_logits,
    prompt_logprobs,
    sample_one,
    slot_probs,
    token_logprobs,
)
from speculative.verify import verify_greedy, verify_seeded
from workers.build import load_models, weight_bytes
from workers.cuda_graphs import StepGraphSet, capture_step_graphs
from workers.device import pick_device, pick_dtype
from workers.kv_cache import KVCache
from workers.kv_sizing import PoolSize, cache_rows
from workers.layers import tp_rank_size
from workers.loader import resolve_model
from workers.memory_profile import memory_at_start, size_pool
from workers.models import ModelConfig
from workers.slot_state import SlotState
from workers.step_io import StepOutput, prepare_inputs, send_back
from workers.sync_guard import no_host_sync

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg, group=None, device: torch.device | None = None):
        self.cfg, self.group = cfg, group
        self.rank, self.tp = tp_rank_size(group)
        self.device = device or pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.check_host_sync = False  # tests turn this on
        if self.device.type == "cuda":
            # cuDNN attention builds an execution plan on the host for every new shape (81 ms
            # each, measured on the H200), and eager forwards meet a new (batch, kv_len) every
            # few steps: they use the memory-efficient kernel. Graphs have fixed shapes and are
            # captured with cuDNN (workers/cuda_graphs.py).
            torch.backends.cuda.enable_cudnn_sdp(False)
        start = time.perf_counter()
        model_dir = resolve_model(cfg.model)
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
        self._allocate(cache_len, size_pool(self, cache_len, at_start))
        log.info(
            "rank %d: weights %.2f GiB on this rank; %s; Eagle3 resource manager %.1f MiB",
            self.rank,
            weight_bytes(self.target, self.drafter) / 2**30,
            self.kv.capacity(self.max_model_len),
            self.resources.nbytes / 2**20,
        )
        if cfg.cuda_graphs and self.device.type == "cuda":
            with torch.inference_mode():
                self.graphs = capture_step_graphs(self)

    def _allocate(self, cache_len: int, size: PoolSize) -> None:
        cfg, tc, drafter, dev = self.cfg, self.target_cfg, self.drafter, self.device
        kv = KVCache.for_models(self.target, drafter, self.tp, size, cache_len, self.dtype, dev)
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
        history_len = cache_len if cfg.prompt_lookup > 0 and drafter is not None else 0
        self.state = SlotState(self.num_slots, self.K, self.M, tc.vocab_size, history_len, dev)
        depth, sees = tree_layout(self.K, self.M)
        self.node_depth, self.tree_sees = depth.to(dev), sees.to(dev)
        self.proposer = None
        if drafter is not None:
            parts = (self.state, self.resources, self.kv)
            self.proposer = Proposer(drafter, *parts, self.K, self.M, cfg.prompt_lookup)

    # ---- the step ----

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        received_at, start = time.time(), time.perf_counter()
        for slot in plan.free_slots:
            self.resources.free(slot)
        for row in plan.prefills:
            if not row.is_continued:
                self.resources.allocate(row.slot)
        self.resources.check_allocated(plan.decode_slots)
        inputs = prepare_inputs(plan, self.device)
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        with no_host_sync(self.check_host_sync):
            tokens, num_emitted, logprobs, prompt = self._run(plan, inputs)
            drafts = self._drafts_for_grammar(plan, inputs) if plan.use_grammar else None
        execute_s = time.perf_counter() - start
        output = send_back(plan.step_id, tokens, num_emitted, execute_s, logprobs, prompt, drafts)
        output.start_event = start_event
        output.received_at, output.launched_at = received_at, time.time()
        return output

    def _drafts_for_grammar(self, plan: StepPlan, inputs: dict) -> tuple[torch.Tensor, ...]:
        """The step's new drafts [rows, K] and siblings [rows, M, K]: the host's grammar follows
        them to build the next step's masks."""
        slots, K = inputs["plan_slots"], max(self.K, 0)
        return self.state.drafts[slots, :K], self.state.siblings[slots, :, :K]

    def _run(self, plan: StepPlan, inputs: dict) -> tuple:
        """-> tokens [rows, K+1], num_emitted [rows], with plan.num_logprobs the rows'
        log-probabilities (`token_logprobs`, each [rows, K+1, ...]) and with
        plan.num_prompt_logprobs the prefills' prompts' ones."""
        self.state.allocate_for(plan)
        if plan.block_updates is not None:
            where = (inputs["block_slots"], inputs["block_index"])
            self.kv.update_tables(inputs["new_slots"], where, inputs["block_ids"])
        if plan.use_grammar:
            self.state.write_grammar(inputs)
        parts, seeds, prompt = [], [], None
        if plan.prefills:
            *part, seed, prompt = self._prefill(plan, inputs)
            parts.append(part)
            seeds.append(seed)
        if plan.decode_slots:
            *part, seed = self._verify(plan, inputs["decode_slots"])
            parts.append(part)
            seeds.append(seed)
        # None: no drafter, or the whole-step graph drafted already
        seeds = [s for s in seeds if s is not None]
        if seeds:
            self.proposer.chain(seeds, plan.kv_len, self.graphs.chain)
        tokens, emitted, logprobs = zip(*parts)
        logprobs = [part for part in logprobs if part is not None]
        logprobs = tuple(map(torch.cat, zip(*logprobs))) if logprobs else None
        return torch.cat(tokens), torch.cat(emitted), logprobs, prompt

    # ---- prefill ----

    def _prefill(self, plan: StepPlan, inp: dict):
        """-> tokens [B, K+1] (the first column real), emitted [B], logprobs or None, the draft
        seed or None, prompt logprobs or None."""
        ids, lens, slots = inp["prefill_ids"], inp["prefill_lens"], inp["prefill_slots"]
        B, T = ids.shape
        self.state.admit(plan, inp)
        graphs = self.graphs.prefill
        logprobs = prompt = None
        kv_len = max(p.start + len(p.token_ids) for p in plan.prefills)
        # chunks that end short of the prompt run eagerly, and so do those after a cached prefix
        # that would pad them into a larger graph than the chunk alone
        last = all(p.next_token < 0 for p in plan.prefills)
        same = graphs is not None and graphs.bucket_length(kv_len) == graphs.bucket_length(T)
        if same and plan.graphable and last and graphs.fits(B, kv_len):
            out = graphs(slots, lens, inp["prefill_starts"], ids, kv_len=kv_len)
        else:
            out, logprobs, prompt = self._prefill_eager(plan, slots, lens, ids, kv_len, inp)
        if self.drafter is not None:
            seed = DraftSeed(slots, out[1], inp["prefill_starts"] + lens - 1, out[2])
        else:
            seed = None
        tokens = F.pad(out[0].unsqueeze(1), (0, self.K))
        emitted = (inp["prefill_next"] < 0).long()  # a chunk short of the end emits nothing
        if plan.use_penalties:
            self.state.count_outputs(slots, tokens[:, :1], emitted.unsqueeze(1).bool())
        return tokens, emitted, logprobs, seed, prompt

    def _prefill_pass(self, slots, lens, ids, kv_len: int, starts):
        """The target over prompts ids [B, T], padded past lens [B], from positions starts [B]
        (past a cached prefix). -> final hidden states [B, T, H], the forward's batch, the
        captured features [B, T, 3H]."""
        B, T = ids.shape
        columns = torch.arange(T, device=self.device).expand(B, T)
        positions = columns + starts.unsqueeze(1)
        batch = self.kv.batch(slots, positions, columns < lens.unsqueeze(1), kv_len)
        features = self.resources.feature_view(B, T)
        hidden, _ = self.target(ids, batch, features)
        return hidden, batch, features

    def _prefill_greedy(self, slots, lens, starts, ids, kv_len: int) -> tuple:
        """The CUDA-graphed prefill. -> first token [B], and with a drafter its output at the
        last prompt position [B, H] and first draft [B]."""
        hidden, batch, features = self._prefill_pass(slots, lens, ids, kv_len, starts)
        rows = torch.arange(ids.shape[0], device=self.device)
        token = self.target.logits(hidden[rows, lens - 1]).argmax(-1)
        return self._after_prefill(ids, lens, token, batch, features)

    def _prefill_eager(self, plan: StepPlan, slots, lens, ids, kv_len: int, inp: dict):
        starts = inp["prefill_starts"]
        hidden, batch, features = self._prefill_pass(slots, lens, ids, kv_len, starts)
        rows = torch.arange(ids.shape[0], device=self.device)
        logits = self.target.logits(hidden[rows, lens - 1].unsqueeze(1))  # [B, 1, V]
        ends = starts + lens  # the chosen token's position
        processed = process_logits(plan, self.state, logits, slots, ends.unsqueeze(1))
        token = sample_one(plan, self.state, processed, slots, ends)
        # a chunk short of the prompt's end continues with the prompt's next token
        token = torch.where(inp["prefill_next"] < 0, token, inp["prefill_next"])
        logprobs = prompt = None
        if plan.num_logprobs is not None:  # padded to K+1 columns, like the tokens
            chosen, top_ids, top_values = token_logprobs(logits, token[:, None], plan.num_logprobs)
            pad = (0, 0, 0, self.K)
            logprobs = (F.pad(chosen, (0, self.K)), F.pad(top_ids, pad), F.pad(top_values, pad))
        if plan.num_prompt_logprobs is not None:
            prompt = prompt_logprobs(self.target.logits, hidden, ids, plan.num_prompt_logprobs)
        out = self._after_prefill(ids, lens, token, batch, features)
        return out, logprobs, prompt

    def _after_prefill(self, ids, lens, token, batch, features) -> tuple:
        rows = torch.arange(ids.shape[0], device=self.device)
        self.state.advance(batch.slots, token, batch.positions[rows, lens - 1] + 1)
        if self.proposer is None:
            return (token,)
        seed = self.proposer.from_prompt(ids, lens, token, features, batch)
        return token, seed.hidden, seed.first_draft

    # ---- verify ----

    def _verify(self, plan: StepPlan, slots: torch.Tensor):
        """-> tokens [B, K+1], num_emitted [B], logprobs or None, and what the draft chain
        continues from (None without a drafter or when the whole-step graph drafted already)."""
        graphs, logprobs = self.graphs.verify, None
        if graphs is not None and plan.graphable and graphs.fits(slots.shape[0], plan.kv_len):
            tokens, emitted, base, path = graphs(slots, kv_len=plan.kv_len)
            if self.cfg.graph_first_draft:
                return tokens, emitted, None, None
        else:
            tokens, emitted, base, path, logprobs = self._verify_eager(plan, slots, plan.kv_len)
        if self.proposer is None:
            return tokens, emitted, logprobs, None
        last, first_draft = self.proposer.after_verify(
            slots, tokens, emitted, base, path, plan.kv_len, self.T
        )
        return tokens, emitted, logprobs, DraftSeed(slots, last, base + emitted - 1, first_draft)

    def _target_pass(self, slots: torch.Tensor, kv_len: int):
        """The target's forward over each row's draft tree (the pending token, the drafts, their
        siblings), writing its K/V and the drafter's features. -> final hidden states [B, T, H],
        the tree's tokens [B, T], the position of the pending token before the step [B]."""
        K, M, B, state = self.K, self.M, slots.shape[0], self.state
        base = state.num_computed[slots]  # [B]
        drafts = [state.drafts[slots, :K]]
        if M:
            drafts.append(state.siblings[slots, :, :K].flatten(1))
        ids = torch.cat([state.last_token[slots].unsqueeze(1), *drafts], dim=1)  # [B, T]
        valid = torch.ones_like(ids, dtype=torch.bool)
        positions = base.unsqueeze(1) + self.node_depth  # [B, T]; a chain's rows: its positions
        if M:
            rows = base.unsqueeze(1) + torch.arange(self.T, device=self.device)
            batch = self.kv.batch(slots, positions, valid, kv_len, rows, self.tree_sees)
        else:
            batch = self.kv.batch(slots, positions, valid, kv_len)
        features = self.resources.feature_view(B, self.T) if self.drafter else None
        hidden, _ = self.target(ids, batch, features)
        return hidden, ids, base

    def _split_tree(self, ids: torch.Tensor):
        """The verify pass's tokens [B, T] -> drafts [B, K], siblings [B, M, K] or None."""
        K, M = self.K, self.M
        siblings = ids[:, K + 1 :].reshape(ids.shape[0], M, K) if M else None
        return ids[:, 1 : K + 1], siblings

    def _verify_greedy(self, slots: torch.Tensor, kv_len: int):
        """The CUDA-graphed verify pass. -> tokens [B, K+1], num_emitted [B], position of the
        pending token before the step [B], the node whose logits chose each token [B, K+1]."""
        hidden, ids, base = self._target_pass(slots, kv_len)
        target_ids = self.target.logits(hidden).argmax(-1)
        tokens, emitted, path = verify_greedy(target_ids, *self._split_tree(ids))
        self._after_verify(slots, tokens, emitted, base, path)
        return tokens, emitted, base, path

    def _verify_eager(self, plan: StepPlan, slots: torch.Tensor, kv_len: int):
        """Verification with sampling, penalties, bias, min_tokens or logprobs, after the
        target pass (replayed from its graph where one fits). -> `_verify_greedy`'s outputs
        and the logprobs or None."""
        K, B = self.K, slots.shape[0]
        graphs = self.graphs.target_pass
        if graphs is not None and graphs.fits(B, kv_len):
            hidden, ids, base = graphs(slots, kv_len=kv_len)
        else:
            hidden, ids, base = self._target_pass(slots, kv_len)
        drafts, siblings = self._split_tree(ids)
        positions = base.unsqueeze(1) + self.node_depth  # [B, T] each node's position
        raw_logits = self.target.logits(hidden)  # [B, T, V]
        # node i's logits choose the token at its position + 1
        logits = process_logits(
            plan, self.state, raw_logits, slots, positions + 1, ids, self.tree_sees
        )
        limit = self.state.draft_limit[slots] if plan.use_draft_limits else None
        if plan.all_greedy:
            tokens, emitted, path = verify_greedy(logits.argmax(-1), drafts, siblings, limit)
        else:
            probs = slot_probs(plan, self.state, logits, slots)
            seeds, chain = self.state.seeds[slots], positions[:, : K + 1]
            tokens, emitted, path = verify_seeded(probs, drafts, siblings, seeds, chain, limit)
        logprobs = None
        if plan.num_logprobs is not None:  # the model's own, before penalties
            rows = torch.arange(B, device=self.device).unsqueeze(1)
            logprobs = token_logprobs(raw_logits[rows, path], tokens, plan.num_logprobs)
        if plan.use_penalties:
            emitted_mask = torch.arange(K + 1, device=self.device) < emitted.unsqueeze(1)
            self.state.count_outputs(slots, tokens, emitted_mask)
        self._after_verify(slots, tokens, emitted, base, path)
        return tokens, emitted, base, path, logprobs

    def _after_verify(self, slots, tokens, emitted, base, path) -> None:
        """Move an accepted sibling's K/V into place and advance the slots."""
        rows = torch.arange(slots.shape[0], device=self.device)
        last = emitted - 1  # the last emitted token's column: its node is the only one to move
        if self.M:
            node = path[rows, last]
            into = torch.where(node != last, slots, self.kv.dummy_slot)
            self.kv.move_target_rows(slots, into, base + node, base + last)
        self.state.advance(slots, tokens[rows, last], base + emitted)
        # past the emitted ones: overwritten before being read
        self.state.record(slots, base.unsqueeze(1) + self.node_depth[: self.K + 1] + 1, tokens)

    # ---- draft ----

    def _decode_step(self, slots: torch.Tensor, kv_len: int):
        """A whole greedy decode step as one CUDA graph (`graph_first_draft`): verify pass,
        first draft forward and draft forwards 2..K. The first draft's shape is fixed at
        [B, K+1] (rows past the accepted tokens write to the dummy slot), so it can be captured,
        which saves its ~40 eager launches and the chain graph's launch and input copies."""
        tokens, emitted, base, path = self._verify_greedy(slots, kv_len)
        last, first_draft = self.proposer.after_verify(
            slots, tokens, emitted, base, path, kv_len, self.T
        )
        self.resources.write_hidden(slots, last)
        self.proposer.draft_steps(slots, first_draft, base + emitted - 1, kv_len)
        return tokens, emitted, base, path
