"""One rank's prefill side of a step: the target over prompt chunks (from a cached prefix's end),
the first token of each finished prompt (greedy from the prefill graphs, else with the logits
processed and sampled eagerly, prompt log-probabilities included) and, with a drafter, the
first draft forward over the prompt. The runner composes it, as it does the Verifier."""

import torch
import torch.nn.functional as F

from speculative.plan import StepPlan
from speculative.proposer import DraftSeed, Proposer
from speculative.resource_manager import Eagle3ResourceManager
from speculative.sampling import process_logits, prompt_logprobs, sample_one, token_logprobs
from speculative.slot_state import SlotState
from workers.cuda_graphs import StepGraphs
from workers.layers import attention_backend, fp8
from workers.layers.kv_cache import KVCache

# a prefill after a cached prefix replays the graph of prefix + chunk where that is at most this
# long or twice the chunk's own bucket: an estimate (not yet measured on a GPU) of where the padded
# tokens cost less than the eager forward's ~600 launches
SHORT_PREFILL = 256


class Prefiller:
    def __init__(
        self,
        target,
        state: SlotState,
        resources: Eagle3ResourceManager,
        kv: KVCache,
        proposer: Proposer | None,
        K: int,
    ):
        self.target, self.state, self.resources, self.kv = target, state, resources, kv
        self.proposer, self.K = proposer, K  # proposer None without a drafter
        self.device = state.device

    def run(self, plan: StepPlan, inp: dict, graphs: StepGraphs | None):
        """-> tokens [B, K+1] (the first column real), emitted [B], logprobs or None, the draft
        seed or None, prompt logprobs or None."""
        ids, lens, slots = inp["prefill_ids"], inp["prefill_lens"], inp["prefill_slots"]
        B, T = ids.shape
        self.state.admit(plan, inp)
        logprobs = prompt = None
        kv_len = max(p.start + len(p.token_ids) for p in plan.prefills)
        # chunks that end short of the prompt run eagerly, and so do those after a cached prefix
        # long enough to pad them into a much larger graph than the chunk alone; but rows the
        # kernel reads replay their own length's graph, whatever the prefix (`graphed`)
        graph_len = T if attention_backend.use_paged_kernel(self.device, T) else kv_len
        last = all(p.next_token < 0 for p in plan.prefills)
        bucket = graphs.bucket_length(graph_len) if graphs is not None else None
        cheap = bucket is not None and bucket <= max(2 * graphs.bucket_length(T), SHORT_PREFILL)
        if cheap and plan.graphable and last and graphs.fits(B, graph_len):
            out = graphs(slots, lens, inp["prefill_starts"], ids, kv_len=graph_len)
        else:
            out, logprobs, prompt = self._eager(plan, slots, lens, ids, kv_len, inp)
        if self.proposer is not None:
            seed = DraftSeed(slots, out[1], inp["prefill_starts"] + lens - 1, out[2])
        else:
            seed = None
        tokens = F.pad(out[0].unsqueeze(1), (0, self.K))
        emitted = (inp["prefill_next"] < 0).long()  # a chunk short of the end emits nothing
        if plan.use_penalties:
            self.state.count_outputs(slots, tokens[:, :1], emitted.unsqueeze(1).bool())
        return tokens, emitted, logprobs, seed, prompt

    def _pass(self, slots, lens, ids, kv_len: int, starts):
        """The target over prompts ids [B, T], padded past lens [B], from positions starts [B]
        (past a cached prefix). -> final hidden states [B, T, H], the forward's batch, the
        captured features [B, T, 3H]."""
        B, T = ids.shape
        columns = torch.arange(T, device=self.device).expand(B, T)
        positions = columns + starts.unsqueeze(1)
        batch = self.kv.batch(slots, positions, columns < lens.unsqueeze(1), kv_len)
        features = self.resources.feature_view(B, T)
        with fp8.prefill_forward():
            hidden, _ = self.target(ids, batch, features)
        return hidden, batch, features

    def greedy(self, slots, lens, starts, ids, kv_len: int) -> tuple:
        """The CUDA-graphed prefill. -> first token [B], and with a drafter its output at the
        last prompt position [B, H] and first draft [B]."""
        hidden, batch, features = self._pass(slots, lens, ids, kv_len, starts)
        rows = torch.arange(ids.shape[0], device=self.device)
        token = self.target.logits(hidden[rows, lens - 1]).argmax(-1)
        return self._after(ids, lens, token, batch, features)

    def graphed(self, slots, lens, starts, ids, kv_len: int) -> tuple:
        """The prefill graphs' function: a bucket of rows the paged kernel reads (each row's own
        keys) gets the whole cache's block table, so it serves a chunk past any cached prefix."""
        if attention_backend.use_paged_kernel(self.device, ids.shape[1]):
            kv_len = self.kv.cache_len
        return self.greedy(slots, lens, starts, ids, kv_len)

    def _eager(self, plan: StepPlan, slots, lens, ids, kv_len: int, inp: dict):
        starts = inp["prefill_starts"]
        hidden, batch, features = self._pass(slots, lens, ids, kv_len, starts)
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
            targets = self._prompt_targets(ids, lens, inp["prefill_next"])
            prompt = prompt_logprobs(self.target.logits, hidden, targets, plan.num_prompt_logprobs)
        out = self._after(ids, lens, token, batch, features)
        return out, logprobs, prompt

    def _prompt_targets(self, ids, lens, next_token) -> torch.Tensor:
        """The token each position of prefill chunks ids [B, T] is followed by: the chunk's next,
        then a chunk short of the prompt's end its next_token (else 0: the output, not scored)."""
        rows = torch.arange(ids.shape[0], device=self.device)
        targets = F.pad(ids[:, 1:], (0, 1))
        targets[rows, lens - 1] = next_token.clamp(min=0)
        return targets

    def _after(self, ids, lens, token, batch, features) -> tuple:
        rows = torch.arange(ids.shape[0], device=self.device)
        self.state.advance(batch.slots, token, batch.positions[rows, lens - 1] + 1)
        if self.proposer is None:
            return (token,)
        seed = self.proposer.from_prompt(ids, lens, token, features, batch)
        return token, seed.hidden, seed.first_draft
