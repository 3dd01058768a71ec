"""One rank's share of a step: the target shard, the drafter shard, their KV caches, the Eagle3
resource manager and the per-slot device state, and the speculative step itself.

Per slot, the device holds the pending token (emitted, not yet run through the target), the current
drafts, the target's KV length and the sampling parameters. A plan therefore only says "continue
slot s": it never needs the previous step's tokens on the host, which is what lets the coordinator
keep a step in flight."""

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculative.config import MAX_LOGIT_BIAS, MAX_STOP_IDS, EngineConfig
from speculative.draft_tree import tree_layout
from speculative.plan import StepPlan
from speculative.prompt_lookup import lookup
from speculative.resource_manager import Eagle3ResourceManager
from speculative.verify import (
    ACCEPT_STREAM,
    SAMPLE_STREAM,
    SIBLING_STREAM,
    apply_penalties,
    sample,
    target_probs,
    token_logprobs,
    uniform,
    verify_greedy,
    verify_sampled,
)
from workers.attention import ForwardBatch, allocate_kv_cache
from workers.device import pick_device, pick_dtype
from workers.layers import tp_rank_size
from workers.llama import LlamaConfig
from workers.loader import load_config, load_models, resolve_model
from workers.step_io import StepOutput, prepare_inputs, send_back
from workers.sync_guard import no_host_sync

log = logging.getLogger(__name__)
PREFILL_GRAPH_TOKENS = 2048  # prefills of up to this many (padded) tokens run as CUDA graphs


@dataclass
class DraftSeed:
    """What the draft chain continues from, per row: slot, drafter output, its position, first draft."""

    slots: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, H]
    positions: torch.Tensor  # [B]
    first_draft: torch.Tensor  # [B]


class ModelRunner:
    def __init__(self, cfg: EngineConfig, group=None, device: torch.device | None = None):
        self.cfg = cfg
        self.group = group
        self.rank, self.tp = tp_rank_size(group)
        self.device = device or pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.check_host_sync = False  # tests turn this on
        if self.device.type == "cuda":
            # cuDNN attention builds an execution plan on the host for every new shape (81 ms each,
            # measured on the H200), and eager forwards (the first draft unless graph_first_draft,
            # sampled verify, long prefills) meet a new (batch, kv_len) every few steps: they use the
            # memory-efficient kernel. Graphs have fixed shapes (one plan each, built at capture) and
            # are captured with cuDNN, which made plain decoding 1.26x and EAGLE-3 1.31x faster at
            # batch 8 on the H200, and lets them run GQA attention without copies (workers/attention.py);
            # EAGLESERVE_CUDNN_IN_GRAPHS=0 captures them without it.
            torch.backends.cuda.enable_cudnn_sdp(False)
        start = time.perf_counter()
        model_dir = resolve_model(cfg.model)
        self.target_cfg = LlamaConfig.from_hf(load_config(model_dir))
        self.K = cfg.k
        self.M = cfg.draft_siblings if self.K else 0  # siblings per depth in the draft tree
        self.T = 1 + self.K * (self.M + 1)  # tokens per row in the verify pass
        self.max_model_len = self.target_cfg.max_len(cfg.max_model_len)
        # room for K+1 tokens past the last real one, twice (a step in flight may overrun a finished
        # request), and for the verify pass's siblings past the chain
        self.cache_len = self.max_model_len + 2 * (self.K + 1) + self.K * self.M + 1
        self.target, self.drafter = load_models(
            cfg, self.target_cfg, model_dir, group, self.device, self.dtype, self.cache_len
        )
        log.info(
            "rank %d: loaded %s (drafter %s) in %.1f s",
            self.rank,
            cfg.model,
            cfg.drafter,
            time.perf_counter() - start,
        )
        self._allocate()
        self.verify_graphs = self.pass_graphs = self.chain_graphs = self.prefill_graphs = None
        self.graph_pool_bytes = 0
        if cfg.cuda_graphs and self.device.type == "cuda":
            with torch.inference_mode():
                self.capture_graphs()

    def _allocate(self) -> None:
        cfg, tc = self.cfg, self.target_cfg
        kv_heads, D = tc.num_key_value_heads // self.tp, tc.head_dim
        bytes_per_el = torch.finfo(self.dtype).bits // 8
        draft_layers = 1 if self.drafter is not None else 0
        draft_kv = self.drafter.cfg.num_key_value_heads // self.tp if self.drafter else 0
        draft_D = self.drafter.cfg.head_dim if self.drafter else 0
        per_slot = (
            2
            * self.cache_len
            * bytes_per_el
            * (tc.num_hidden_layers * kv_heads * D + draft_layers * draft_kv * draft_D)
        )
        self.num_slots = cfg.max_batch_size
        if cfg.memory_budget_gb is not None:
            fits = int(cfg.memory_budget_gb * 2**30 // per_slot)
            if fits < 1:
                raise ValueError(
                    f"memory_budget_gb={cfg.memory_budget_gb} holds no request slot "
                    f"({per_slot / 2**20:.1f} MiB of KV cache per slot)"
                )
            self.num_slots = min(self.num_slots, fits)
        self.kv_cache = allocate_kv_cache(
            tc.num_hidden_layers,
            self.num_slots,
            self.cache_len,
            kv_heads,
            D,
            self.dtype,
            self.device,
        )
        for layer, cache in zip(self.target.layers, self.kv_cache):
            layer.self_attn.cache = cache
        self.draft_kv_cache = None
        if self.drafter is not None:
            self.draft_kv_cache = allocate_kv_cache(
                1, self.num_slots, self.cache_len, draft_kv, draft_D, self.dtype, self.device
            )
            self.drafter.midlayer.self_attn.cache = self.draft_kv_cache[0]
        max_step_tokens = max(cfg.max_num_batched_tokens, self.num_slots * self.T)
        self.resources = Eagle3ResourceManager(
            self.num_slots,
            max_step_tokens,
            len(self.target.aux_layer_ids) * tc.hidden_size,
            self.drafter.cfg.hidden_size if self.drafter else tc.hidden_size,
            self.dtype,
            self.device,
        )
        n, dev = self.num_slots + 1, self.device
        self.last_token = torch.zeros(n, dtype=torch.long, device=dev)  # [slots+1]
        self.drafts = torch.zeros(n, max(self.K, 1), dtype=torch.long, device=dev)  # [slots+1, K]
        self.siblings = torch.zeros(
            n, self.M, max(self.K, 1), dtype=torch.long, device=dev
        )  # [slots+1, M, K]
        depth, sees = tree_layout(self.K, self.M)
        self.node_depth, self.tree_sees = depth.to(dev), sees.to(dev)
        self.num_computed = torch.zeros(n, dtype=torch.long, device=dev)  # target KV length
        self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.frequency_penalty = torch.zeros(n, dtype=torch.float32, device=dev)
        self.presence_penalty = torch.zeros(n, dtype=torch.float32, device=dev)
        self.repetition_penalty = torch.ones(n, dtype=torch.float32, device=dev)
        # from the first step with penalties: [slots+1, V] each slot's output tokens, and its prompt's
        self.output_counts = self.in_prompt = None
        self.bias_ids = self.bias_values = (
            None  # [slots+1, MAX_LOGIT_BIAS]: logit_bias, from the first step using it
        )
        # min_tokens, from the first step using it: [slots+1] the first position at which EOS and stop
        # tokens may be emitted, and [slots+1, MAX_STOP_IDS] those tokens (-1: none)
        self.stops_from = self.stop_ids = None
        # with prompt lookup: every slot's tokens by position (prompt, output, the chain's drafts)
        self.history = (
            torch.zeros(n, self.cache_len, dtype=torch.long, device=dev)
            if cfg.prompt_lookup > 0 and self.drafter is not None
            else None
        )
        kv_bytes = self.kv_cache.nbytes + (
            self.draft_kv_cache.nbytes if self.draft_kv_cache is not None else 0
        )
        log.info(
            "rank %d: %d request slots x %d tokens; KV cache %.1f MiB (target + drafter), "
            "Eagle3 resource manager %.1f MiB",
            self.rank,
            self.num_slots,
            self.cache_len,
            kv_bytes / 2**20,
            self.resources.nbytes / 2**20,
        )

    # ---- the step ----

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        received_at, start = time.time(), time.perf_counter()
        for slot in plan.free_slots:
            self.resources.free(slot)
        for row in plan.prefills:
            self.resources.allocate(row.slot)
        self.resources.check_allocated(plan.decode_slots)
        inputs = prepare_inputs(plan, self.device)
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        with no_host_sync(self.check_host_sync):
            tokens, num_emitted, logprobs = self._run(plan, inputs)
        output = send_back(
            plan.step_id,
            tokens,
            num_emitted,
            time.perf_counter() - start,
            logprobs,
            self.prompt_logprobs,
        )
        output.start_event = start_event
        output.received_at, output.launched_at = received_at, time.time()
        return output

    def _run(self, plan: StepPlan, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """-> tokens [rows, K+1], num_emitted [rows], and with plan.num_logprobs the rows' log-probabilities
        (`token_logprobs`, each [rows, K+1, ...])."""
        outs, seeds = [], []
        self.logprob_parts = []  # filled by the eager prefill and verify, rows in order
        self.prompt_logprobs = None  # filled by the eager prefill
        if plan.use_penalties and self.output_counts is None:
            self.output_counts = torch.zeros(
                self.num_slots + 1,
                self.target_cfg.vocab_size,
                dtype=torch.int32,
                device=self.device,
            )
            self.in_prompt = torch.zeros_like(self.output_counts, dtype=torch.bool)
        if plan.use_logit_bias and self.bias_ids is None:
            self.bias_ids = torch.zeros(
                self.num_slots + 1, MAX_LOGIT_BIAS, dtype=torch.long, device=self.device
            )
            self.bias_values = torch.zeros(self.num_slots + 1, MAX_LOGIT_BIAS, device=self.device)
        if plan.use_min_tokens and self.stops_from is None:
            self.stops_from = torch.zeros(self.num_slots + 1, dtype=torch.long, device=self.device)
            self.stop_ids = torch.full(
                (self.num_slots + 1, MAX_STOP_IDS), -1, dtype=torch.long, device=self.device
            )
        if plan.prefills:
            tokens, emitted, seed = self._prefill(plan, inputs)
            outs.append((tokens, emitted))
            seeds.append(seed)
        if plan.decode_slots:
            tokens, emitted, seed = self._verify(plan, inputs["decode_slots"])
            outs.append((tokens, emitted))
            seeds.append(seed)
        seeds = [
            s for s in seeds if s is not None
        ]  # None: no drafter, or the step graph drafted already
        if seeds:
            self._draft_chain(plan, seeds)
        logprobs = tuple(map(torch.cat, zip(*self.logprob_parts))) if self.logprob_parts else None
        return torch.cat([t for t, _ in outs]), torch.cat([e for _, e in outs]), logprobs

    def _batch(self, slots, positions, valid, kv_len, rows=None, tree=None) -> ForwardBatch:
        """rows [B, T]: where to write each token's K/V (default: at its position)."""
        dummy = self.resources.dummy_slot
        # rows read per slot: a multiple of 16 (the memory-efficient attention kernel's mask alignment), within the cache
        kv_len = min(-(-kv_len // 16) * 16, self.cache_len)
        write_slots = torch.where(valid, slots.unsqueeze(1), dummy)
        positions = positions.clamp(max=self.cache_len - 1)
        rows = positions if rows is None else rows.clamp(max=self.cache_len - 1)
        return ForwardBatch(slots, positions, write_slots, rows, kv_len, tree)

    def _prefill(self, plan: StepPlan, inp: dict):
        ids, lens, slots = inp["prefill_ids"], inp["prefill_lens"], inp["prefill_slots"]
        B, T = ids.shape
        for name in (
            "seeds",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            state = getattr(self, name)
            state.index_copy_(0, slots, inp[f"prefill_{name}"].to(state.dtype))
        if plan.use_logit_bias:
            self.bias_ids.index_copy_(0, slots, inp["prefill_bias_ids"])
            self.bias_values.index_copy_(0, slots, inp["prefill_bias_values"])
        elif (
            self.bias_values is not None
        ):  # an earlier request's bias must not reach a later one in its slot
            self.bias_values.index_fill_(0, slots, 0.0)
        if plan.use_min_tokens:
            self.stops_from.index_copy_(0, slots, inp["prefill_stops_from"])
            self.stop_ids.index_copy_(0, slots, inp["prefill_stop_ids"])
        elif self.stops_from is not None:  # nor its min_tokens
            self.stops_from.index_fill_(0, slots, 0)
        if plan.use_penalties:  # the output so far: the prompt's earlier output (a resumed request)
            self.output_counts.index_fill_(0, slots, 0)
            positions = torch.arange(T, device=self.device)
            in_prompt = positions < lens.unsqueeze(1)
            prior = positions >= (lens - inp["prefill_prior_output_tokens"]).unsqueeze(1)
            self._count_outputs(slots, ids, prior & in_prompt)
            prompt_counts = torch.zeros(
                B, self.target_cfg.vocab_size, dtype=torch.int32, device=self.device
            )
            self.in_prompt.index_copy_(
                0, slots, prompt_counts.scatter_add_(1, ids, in_prompt.int()) > 0
            )
        if self.prefill_graphs is not None and plan.graphable and self.prefill_graphs.fits(B, T):
            out = self.prefill_graphs(slots, lens, ids, kv_len=T)
        else:
            out = self._prefill_forward(slots, lens, ids, kv_len=T, plan=plan)
        seed = DraftSeed(slots, out[1], lens - 1, out[2]) if self.drafter is not None else None
        tokens = torch.zeros(B, self.K + 1, dtype=torch.long, device=self.device)
        tokens[:, 0] = out[0]
        emitted = torch.ones(B, dtype=torch.long, device=self.device)
        if plan.use_penalties:
            self._count_outputs(slots, tokens[:, :1], emitted.unsqueeze(1).bool())
        return tokens, emitted, seed

    def _prefill_forward(
        self,
        slots: torch.Tensor,
        lens: torch.Tensor,
        ids: torch.Tensor,
        kv_len: int,
        plan: StepPlan | None = None,
    ) -> tuple:
        """Target (and drafter) forward over whole prompts ids [B, T], padded past lens [B], and the
        slot-state update. Greedy when `plan` is None (the CUDA-graphed form). -> first token [B],
        and with a drafter its output at the last prompt position [B, H] and first draft [B]."""
        B, T = ids.shape
        rows = torch.arange(B, device=self.device)
        positions = torch.arange(T, device=self.device).expand(B, T)
        batch = self._batch(slots, positions, positions < lens.unsqueeze(1), kv_len)
        features = self.resources.feature_view(B, T)
        hidden, _ = self.target(ids, batch, features)
        logits = self.target.logits(hidden[rows, lens - 1].unsqueeze(1))  # [B, 1, V]
        token = (
            logits[:, 0].argmax(-1)
            if plan is None
            else self._sample_one(
                plan, self._bias_and_penalise(plan, logits, slots, lens.unsqueeze(1)), slots, lens
            )
        )
        if (
            plan is not None and plan.num_logprobs is not None
        ):  # padded to K+1 columns, like the tokens
            chosen, top_ids, top_logprobs = token_logprobs(
                logits, token.unsqueeze(1), plan.num_logprobs
            )
            K = self.K
            self.logprob_parts.append(
                (
                    F.pad(chosen, (0, K)),
                    F.pad(top_ids, (0, 0, 0, K)),
                    F.pad(top_logprobs, (0, 0, 0, K)),
                )
            )
        if plan is not None and plan.num_prompt_logprobs is not None:
            self.prompt_logprobs = self._prompt_logprobs(hidden, ids, plan.num_prompt_logprobs)
        self.last_token.index_copy_(0, slots, token)
        self.num_computed.index_copy_(0, slots, lens)
        if self.drafter is None:
            return (token,)
        # drafter input at position t: target feature at t + the token at t+1
        draft_ids = ids.roll(-1, dims=1).index_put((rows, lens - 1), token)
        h = self.drafter(draft_ids, features, batch, from_features=True)
        last = h[rows, lens - 1]
        self._record(slots, positions, ids)
        self._record(
            slots, lens.unsqueeze(1), token.unsqueeze(1)
        )  # after: it overwrites the padding at lens
        return token, last, self._propose(last, slots, lens - 1, depth=0)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, ids: torch.Tensor, num_top: int, chunk: int = 512
    ) -> tuple:
        """`token_logprobs` of the prompts' tokens ids [B, T] after the tokens before them (column t:
        token t; column 0 and the padding hold zeros), a row and `chunk` positions at a time: a
        prompt's logits over the whole vocabulary at once could take GBs."""
        B, T = ids.shape
        chosen = torch.zeros(B, T, device=self.device)
        top_ids = torch.zeros(B, T, num_top, dtype=torch.long, device=self.device)
        top_logprobs = torch.zeros(B, T, num_top, device=self.device)
        for b in range(B):
            for s in range(0, T - 1, chunk):
                e = min(s + chunk, T - 1)
                c, i, v = token_logprobs(
                    self.target.logits(hidden[b : b + 1, s:e]),
                    ids[b : b + 1, s + 1 : e + 1],
                    num_top,
                )
                (
                    chosen[b, s + 1 : e + 1],
                    top_ids[b, s + 1 : e + 1],
                    top_logprobs[b, s + 1 : e + 1],
                ) = c[0], i[0], v[0]
        return chosen, top_ids, top_logprobs

    def _sample_one(self, plan, logits, slots, positions) -> torch.Tensor:
        """logits [B, 1, V] -> one token per row, the token at `positions` [B]."""
        if plan.all_greedy:
            return logits[:, 0].argmax(-1)
        probs = self._probs(plan, logits, slots)
        return sample(
            probs[:, 0], uniform(self.seeds[slots], positions.unsqueeze(1), SAMPLE_STREAM)[:, 0]
        )

    def _probs(self, plan, logits, slots):
        top_k = self.top_k[slots] if plan.use_top_k_top_p else None
        min_p = self.min_p[slots] if plan.use_min_p else None
        return target_probs(logits, self.temperature[slots], top_k, self.top_p[slots], min_p)

    def _verify(self, plan: StepPlan, slots: torch.Tensor):
        """-> tokens [B, K+1], num_emitted [B], and what the draft chain continues from (None when
        the graph of the whole step (`graph_first_draft`) ran the drafter already)."""
        if (
            self.verify_graphs is not None
            and plan.graphable
            and self.verify_graphs.fits(slots.shape[0], plan.kv_len)
        ):
            tokens, emitted, base, path = self.verify_graphs(slots, kv_len=plan.kv_len)
            if self.drafter is None or self.cfg.graph_first_draft:
                return tokens, emitted, None
        else:
            tokens, emitted, base, path = self._verify_target(slots, kv_len=plan.kv_len, plan=plan)
        if self.drafter is None:
            return tokens, emitted, None
        last, first_draft = self._first_draft(slots, tokens, emitted, base, path, plan.kv_len)
        return tokens, emitted, DraftSeed(slots, last, base + emitted - 1, first_draft)

    def _first_draft(self, slots, tokens, emitted, base, path, kv_len: int):
        """The first draft forward over the accepted + 1 tokens of each row (tokens [B, K+1], padded
        past emitted [B]), fed by the target features the verify pass captured at the nodes of
        `path` [B, K+1]. -> the drafter's output at the last accepted token [B, H], first draft [B]."""
        K, B = self.K, slots.shape[0]
        rows = torch.arange(B, device=self.device)
        accepted = emitted - 1
        positions = base.unsqueeze(1) + torch.arange(K + 1, device=self.device)
        valid = torch.arange(K + 1, device=self.device) <= accepted.unsqueeze(1)
        dbatch = self._batch(slots, positions, valid, kv_len)
        features = self.resources.feature_view(B, self.T)
        if self.M:
            features = features[rows.unsqueeze(1), path]
        h = self.drafter(tokens, features, dbatch, from_features=True)
        last = h[rows, accepted]
        return last, self._propose(last, slots, base + accepted, depth=0)

    def _decode_step(self, slots: torch.Tensor, kv_len: int):
        """A whole greedy decode step as one CUDA graph (`graph_first_draft`): verify pass, first
        draft forward and draft forwards 2..K. The first draft's shape is fixed at [B, K+1] (rows
        past the accepted tokens write to the dummy slot), so it can be captured, which saves its
        ~40 eager launches and the chain graph's launch and input copies in every step."""
        tokens, emitted, base, path = self._verify_target(slots, kv_len)
        last, first_draft = self._first_draft(slots, tokens, emitted, base, path, kv_len)
        self.resources.write_hidden(slots, last)
        self._draft_steps(slots, first_draft, base + emitted - 1, kv_len)
        return tokens, emitted, base, path

    def _target_pass(self, slots: torch.Tensor, kv_len: int):
        """The target's forward over each row's draft tree (the pending token, the drafts, their
        siblings), writing its K/V and the drafter's features. -> final hidden states [B, T, H], the
        tree's tokens [B, T], the position of the pending token before the step [B]. Also captured
        on its own, for the steps whose verification runs eager (not `plan.graphable`)."""
        K, M, B = self.K, self.M, slots.shape[0]
        base = self.num_computed[slots]  # [B]
        drafts = [self.drafts[slots, :K]] + ([self.siblings[slots, :, :K].flatten(1)] if M else [])
        ids = torch.cat([self.last_token[slots].unsqueeze(1)] + drafts, dim=1)  # [B, T]
        valid = torch.ones_like(ids, dtype=torch.bool)
        positions = base.unsqueeze(1) + self.node_depth  # [B, T]; a chain's rows are its positions
        batch = (
            self._batch(slots, positions, valid, kv_len)
            if not M
            else self._batch(
                slots,
                positions,
                valid,
                kv_len,
                rows=base.unsqueeze(1) + torch.arange(self.T, device=self.device),
                tree=self.tree_sees,
            )
        )
        hidden, _ = self.target(
            ids, batch, self.resources.feature_view(B, self.T) if self.drafter else None
        )
        return hidden, ids, base

    def _verify_target(self, slots: torch.Tensor, kv_len: int, plan: StepPlan | None = None):
        """The target pass, verification and the slot-state update. Greedy when `plan` is None (the
        CUDA-graphed form); with a plan, the pass alone replays its graph where one fits. -> tokens
        [B, K+1], num_emitted [B], position of the pending token before the step [B], and the node
        whose logits chose each token [B, K+1]."""
        K, M, B = self.K, self.M, slots.shape[0]
        rows = torch.arange(B, device=self.device)
        graphs = self.pass_graphs if plan is not None and self.pass_graphs is not None else None
        if graphs is not None and graphs.fits(B, kv_len):
            hidden, ids, base = graphs(slots, kv_len=kv_len)
        else:
            hidden, ids, base = self._target_pass(slots, kv_len)
        drafts = ids[:, 1 : K + 1]  # [B, K]
        siblings = ids[:, K + 1 :].reshape(B, M, K) if M else None  # [B, M, K]
        positions = base.unsqueeze(1) + self.node_depth  # [B, T] each node's position
        chain = positions[:, : K + 1]  # [B, K+1] the chain's
        logits = raw_logits = self.target.logits(hidden)  # [B, T, V]
        if plan is not None:  # node i's logits choose the token at its position + 1
            logits = self._bias_and_penalise(plan, logits, slots, positions + 1, ids)
        if plan is None or plan.all_greedy:
            tokens, emitted, path = verify_greedy(logits.argmax(-1), drafts, siblings)
        else:
            seeds = self.seeds[slots]
            u_sibling = (
                torch.stack([uniform(seeds, chain[:, 1:], SIBLING_STREAM + m) for m in range(M)], 1)
                if M
                else None
            )
            tokens, emitted, path = verify_sampled(
                self._probs(plan, logits, slots),
                drafts,
                uniform(seeds, chain[:, 1:], ACCEPT_STREAM),
                uniform(seeds, chain + 1, SAMPLE_STREAM),
                siblings,
                u_sibling,
            )
        if plan is not None and plan.num_logprobs is not None:  # the model's own, before penalties
            self.logprob_parts.append(
                token_logprobs(raw_logits[rows.unsqueeze(1), path], tokens, plan.num_logprobs)
            )
        if plan is not None and plan.use_penalties:
            self._count_outputs(
                slots, tokens, torch.arange(K + 1, device=self.device) < emitted.unsqueeze(1)
            )
        if M:
            self._move_sibling_kv(slots, base, path, emitted)
        self.last_token.index_copy_(0, slots, tokens[rows, emitted - 1])
        self.num_computed.index_copy_(0, slots, base + emitted)
        self._record(
            slots, chain + 1, tokens
        )  # past the emitted ones: overwritten before being read
        return tokens, emitted, base, path

    def _move_sibling_kv(self, slots, base, path, emitted) -> None:
        """An accepted sibling's K/V, in every target layer, from its tree row to its position's row
        (the rejected chain draft's). Rows without one copy into the dummy slot."""
        rows = torch.arange(slots.shape[0], device=self.device)
        last = (
            emitted - 1
        )  # the last emitted token's column: its node is the only one that may move
        node = path[rows, last]
        into = torch.where(node != last, slots, self.resources.dummy_slot)
        end = self.cache_len - 1
        self.kv_cache[:, :, into, (base + last).clamp(max=end)] = self.kv_cache[
            :, :, slots, (base + node).clamp(max=end)
        ]

    def _bias_and_penalise(
        self,
        plan: StepPlan,
        logits: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        tree_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """OpenAI's logit_bias and penalties, and vLLM's min_tokens, on logits [B, T, V] that choose the
        tokens at `positions` [B, T]. With tree_ids [B, T] (the verify pass's tokens), node i follows the
        output so far and the drafts on its path, as if accepted."""
        B, T, _ = logits.shape
        if plan.use_logit_bias:
            logits = logits.scatter_add(
                -1,
                self.bias_ids[slots].unsqueeze(1).expand(B, T, -1),
                self.bias_values[slots].unsqueeze(1).expand(B, T, -1),
            )
        if plan.use_min_tokens:  # no EOS or stop token before min_tokens
            ids = self.stop_ids[slots].unsqueeze(1).expand(B, T, -1)
            early = (positions < self.stops_from[slots].unsqueeze(1)).unsqueeze(-1) & (ids >= 0)
            logits = logits.scatter_add(
                -1, ids.clamp(min=0), torch.where(early, float("-inf"), 0.0)
            )
        if plan.use_penalties:
            counts = self.output_counts[slots].unsqueeze(1).float()
            if tree_ids is not None:
                drafted = torch.zeros_like(logits)
                drafted[:, 1:].scatter_(-1, tree_ids[:, 1:].unsqueeze(-1), 1.0)
                counts = counts + torch.einsum(
                    "ij,bjv->biv", self.tree_sees.to(logits.dtype), drafted
                )
            logits = apply_penalties(
                logits,
                counts,
                self.frequency_penalty[slots],
                self.presence_penalty[slots],
                self.repetition_penalty[slots],
                self.in_prompt[slots],
            )
        return logits

    def _count_outputs(
        self, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Penalties: add tokens [B, T] where valid [B, T] to their slots' output counts."""
        rows = slots.unsqueeze(1).expand_as(tokens)
        self.output_counts.index_put_(
            (rows, tokens), valid.to(self.output_counts.dtype), accumulate=True
        )

    def _draft_chain(self, plan: StepPlan, seeds: list[DraftSeed]) -> None:
        slots = torch.cat([s.slots for s in seeds])
        draft = torch.cat([s.first_draft for s in seeds])
        positions = torch.cat([s.positions for s in seeds])
        self.resources.write_hidden(slots, torch.cat([s.hidden for s in seeds]))
        if self.chain_graphs is not None and self.chain_graphs.fits(slots.shape[0], plan.kv_len):
            self.chain_graphs(slots, draft, positions, kv_len=plan.kv_len)
        else:
            self._draft_steps(slots, draft, positions, kv_len=plan.kv_len)

    def _draft_steps(
        self, slots: torch.Tensor, draft: torch.Tensor, positions: torch.Tensor, kv_len: int
    ):
        """Draft forwards 2..K, one token per row, each launched from the previous one's tensors.
        slots, draft (the first draft), positions (of the drafter output that made it): [B]."""
        drafts = [draft]
        one = torch.ones(slots.shape[0], 1, dtype=torch.bool, device=self.device)
        for k in range(1, self.K):
            batch = self._batch(slots, (positions + k).unsqueeze(1), one, kv_len)
            hidden = self.resources.read_hidden(slots).unsqueeze(1)  # [B, 1, H]
            h = self.drafter(drafts[-1].unsqueeze(1), hidden, batch, from_features=False)[:, 0]
            self.resources.write_hidden(slots, h)
            drafts.append(self._propose(h, slots, positions + k, depth=k))
        stacked = torch.stack(drafts, dim=1)  # [B, K]
        self.drafts.index_copy_(0, slots, stacked)
        return (stacked,)

    def _propose(
        self, h: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """The draft from the drafter's output h [B, H] at positions q [B], at 0-based `depth` in the
        chain. With prompt lookup, the looked-up token where the drafter's own is less likely than
        `cfg.prompt_lookup`, recorded at q+2 so that the chain's next lookups see it. With a draft
        tree, the drafter's next M choices become the depth's siblings."""
        if self.history is None:
            top = self.drafter.propose(h, self.M + 1)  # [B, M+1]
            draft, others = top[:, 0], top[:, 1:]
        else:
            top, probability = self.drafter.propose_scored(h, self.M + 1)
            found, copied = lookup(self.history[slots], q)
            copy = found & (probability[:, 0] < self.cfg.prompt_lookup)
            draft = torch.where(copy, copied, top[:, 0])
            others = torch.where(
                copy.unsqueeze(1), top[:, : self.M], top[:, 1:]
            )  # the drafter's own first, if copied over
            self._record(slots, (q + 2).unsqueeze(1), draft.unsqueeze(1))
        if self.M:
            self.siblings[slots, :, depth] = others
        return draft

    def _record(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """With prompt lookup, history[slot, position] = token for positions and tokens [B, T]."""
        if self.history is not None:
            rows = slots.unsqueeze(1).expand_as(positions)
            self.history.index_put_((rows, positions.clamp(max=self.cache_len - 1)), tokens)

    def capture_graphs(self) -> None:
        """CUDA graphs for greedy prefill of up to PREFILL_GRAPH_TOKENS tokens (longer prefills
        amortise their launches), the greedy verify pass (plain decode when K=0), the target pass
        alone (the other steps' verify) and draft steps 2..K. They share one memory pool, which is
        safe only when they replay in the order they were captured: a step runs prefill, then verify
        or the target pass (whose output the eager verification reads before anything else replays),
        then the draft chain."""
        from workers.cuda_graphs import GraphInput, StepGraphs, kv_buckets

        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        slots, dummy, dev = self.num_slots, self.resources.dummy_slot, self.device
        max_tokens = min(PREFILL_GRAPH_TOKENS, self.resources.features.shape[0])
        prompt_lengths = [n for n in kv_buckets(self.max_model_len, 16) if n <= max_tokens]
        self.prefill_graphs = StepGraphs(
            self._prefill_forward,
            slots,
            prompt_lengths,
            dummy,
            [GraphInput(torch.long, pad=1), GraphInput(torch.long, per_token=True)],
            dev,
            max_tokens=max_tokens,
        )
        whole_step = self.cfg.graph_first_draft and self.drafter is not None
        verify = self._decode_step if whole_step else self._verify_target
        self.verify_graphs = StepGraphs(verify, slots, kv_buckets(self.cache_len), dummy, [], dev)
        # the target pass alone, for steps whose verification runs eager: replayed instead of the verify graph
        self.pass_graphs = StepGraphs(
            self._target_pass, slots, kv_buckets(self.cache_len), dummy, [], dev
        )
        graphs = [self.prefill_graphs, self.verify_graphs, self.pass_graphs]
        if self.drafter is not None and self.K > 1:
            self.chain_graphs = StepGraphs(
                self._draft_steps,
                slots,
                kv_buckets(self.cache_len),
                dummy,
                [GraphInput(torch.long), GraphInput(torch.long)],
                dev,
            )
            graphs.append(self.chain_graphs)
        pool = None
        torch.backends.cuda.enable_cudnn_sdp(
            os.environ.get("EAGLESERVE_CUDNN_IN_GRAPHS", "1") != "0"
        )
        try:
            for g in graphs:
                g.pool = pool
                g.capture_all()
                pool = g.pool
        finally:
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.cuda.synchronize()
        self.graph_pool_bytes = free_before - torch.cuda.mem_get_info()[0]
        log.info(
            "rank %d: captured %d CUDA graphs in %.1f s (%.1f MiB)",
            self.rank,
            sum(len(g.graphs) for g in graphs),
            time.perf_counter() - start,
            self.graph_pool_bytes / 2**20,
        )
