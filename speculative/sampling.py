"""Logits processing and sampling on the device: grammar bitmasks, logit_bias, min_tokens,
penalties, temperature, min-p, top-k, top-p, log-probabilities, and the random numbers, with no
host synchronisation.

Randomness is counter based: a uniform number is a hash of (request seed, token position, stream),
so every TP rank draws the same numbers, a request's draws do not depend on its batch, and a
seeded request is reproducible.
"""

import torch

from speculative.slot_state import SlotState

ACCEPT_STREAM, SAMPLE_STREAM, SIBLING_STREAM = 1, 2, 3  # sibling m: stream 3 + m
_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # int64 holding 32-bit values; products stay below 2**59, so no overflow
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """seeds [B] int64, positions [B, T] -> uniform floats in [0, 1), [B, T]."""
    s = seeds.unsqueeze(-1)
    h = _hash32((s & _MASK32) ^ _hash32((s >> 32) & _MASK32))
    h = _hash32(h ^ (positions & _MASK32))
    h = _hash32(h ^ stream)
    return (h >> 8).float() * (1.0 / (1 << 24))


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, T, V] float32, per-row params [B] -> the distribution to sample from, [B, T, V]:
    temperature, min-p, top-k, top-p (vLLM's order). Greedy rows (temperature 0) become one-hot at
    the argmax, so one rule serves both modes."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).view(-1, 1, 1)
    if (
        min_p is not None
    ):  # tokens less likely than min_p x the likeliest one's probability; min_p 0 cuts none
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(
            probs < min_p.view(-1, 1, 1) * probs.amax(-1, keepdim=True), float("-inf")
        )
    if top_k is not None:
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(-1, 1, 1), one_hot, probs)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V).view(-1, 1, 1)
    # top-k first, then top-p on the renormalised survivors (the Hugging Face / vLLM order)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))  # [B, T, V]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # keeps the smallest prefix with mass >= top_p; top_p 1 cuts nothing (in float32 the mass
    # reaches 1.0 before the tail, and that row's distribution must not depend on other rows)
    cut = (mass_before >= top_p.view(-1, 1, 1)) & (top_p < 1).view(-1, 1, 1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
    in_prompt: torch.Tensor,
) -> torch.Tensor:
    """logits [B, T, V], counts [B, T, V] of each token in the output before each position, per-row
    penalties [B], in_prompt [B, V] -> the penalised logits: vLLM's repetition penalty over the
    tokens of the prompt and the output, then OpenAI's frequency and presence penalties over the
    output."""
    seen = (counts > 0) | in_prompt.unsqueeze(1)
    r = torch.where(seen, repetition.view(-1, 1, 1), 1.0)
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency.view(-1, 1, 1) * counts - presence.view(-1, 1, 1) * (counts > 0)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, ...]:
    """logits [B, T, V], tokens [B, T] -> the tokens' log-probabilities [B, T], and the ids and
    log-probabilities of the num_top most likely tokens [B, T, num_top]: the model's own
    distribution, before temperature, top-k and top-p (what vLLM reports by default)."""
    logp = logits.float().log_softmax(-1)
    top = logp.topk(num_top, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), top.indices, top.values


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [N, V] (need not be normalised), u [N] in [0, 1) -> ids [N]."""
    cdf = probs.cumsum(-1)
    ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def apply_bitmask(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Structured outputs: logits [B, T, V], packed [B, T, ceil(V / 32)] int32 (bit t % 32 of word
    t // 32 set: token t allowed) -> the logits with every other token at -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).flatten(-2)[..., : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def process_logits(
    plan,
    state: SlotState,
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    tree_ids: torch.Tensor | None = None,
    tree_sees: torch.Tensor | None = None,
) -> torch.Tensor:
    """OpenAI's logit_bias and penalties, and vLLM's min_tokens, on logits [B, T, V] that choose
    the tokens at `positions` [B, T]. With tree_ids [B, T] (the verify pass's tokens) and the
    tree's `sees` [T, T], node i follows the output so far and the drafts on its path, as if
    accepted."""
    B, T, _ = logits.shape
    if plan.use_grammar:
        logits = apply_bitmask(logits, state.grammar_mask[slots, :T])
    if plan.use_logit_bias:
        ids = state.bias_ids[slots].unsqueeze(1).expand(B, T, -1)
        values = state.bias_values[slots].unsqueeze(1).expand(B, T, -1)
        logits = logits.scatter_add(-1, ids, values)
    if plan.use_min_tokens:  # no EOS or stop token before min_tokens
        ids = state.stop_ids[slots].unsqueeze(1).expand(B, T, -1)
        stops_from = state.stops_from[slots].unsqueeze(1)
        early = (positions < stops_from).unsqueeze(-1) & (ids >= 0)
        early = torch.where(early, float("-inf"), 0.0).to(logits.dtype)
        logits = logits.scatter_add(-1, ids.clamp(min=0), early)
    if plan.use_penalties:
        counts = state.output_counts[slots].unsqueeze(1).float()
        if tree_ids is not None:
            drafted = torch.zeros_like(logits)
            drafted[:, 1:].scatter_(-1, tree_ids[:, 1:].unsqueeze(-1), 1.0)
            counts = counts + torch.einsum("ij,bjv->biv", tree_sees.to(logits.dtype), drafted)
        logits = apply_penalties(
            logits,
            counts,
            state.frequency_penalty[slots],
            state.presence_penalty[slots],
            state.repetition_penalty[slots],
            state.in_prompt[slots],
        )
    return logits


def slot_probs(plan, state: SlotState, logits: torch.Tensor, slots: torch.Tensor):
    """logits [B, T, V] -> the slots' sampling distributions [B, T, V]."""
    top_k = state.top_k[slots] if plan.use_top_k_top_p else None
    min_p = state.min_p[slots] if plan.use_min_p else None
    return target_probs(logits, state.temperature[slots], top_k, state.top_p[slots], min_p)


def sample_one(plan, state: SlotState, logits, slots, positions) -> torch.Tensor:
    """logits [B, 1, V] -> one token per row [B], the token at `positions` [B]."""
    if plan.all_greedy:
        return logits[:, 0].argmax(-1)
    probs = slot_probs(plan, state, logits, slots)
    u = uniform(state.seeds[slots], positions.unsqueeze(1), SAMPLE_STREAM)
    return sample(probs[:, 0], u[:, 0])


def prompt_logprobs(logits_fn, hidden, targets: torch.Tensor, num_top: int, chunk: int = 512):
    """`token_logprobs` of targets [B, T] (column t: the token after position t, the next
    prompt token) from the final hidden states [B, T, H] through `logits_fn`, a row and `chunk`
    positions at a time: a prompt's logits over the whole vocabulary at once could take GBs."""
    B, T = targets.shape
    chosen = torch.zeros(B, T, dtype=torch.float32, device=targets.device)
    top_ids = torch.zeros(B, T, num_top, dtype=torch.long, device=targets.device)
    top_logprobs = torch.zeros(B, T, num_top, dtype=torch.float32, device=targets.device)
    for b in range(B):
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            logits = logits_fn(hidden[b : b + 1, s:e])
            c, i, v = token_logprobs(logits, targets[b : b + 1, s:e], num_top)
            chosen[b, s:e] = c[0]
            top_ids[b, s:e] = i[0]
            top_logprobs[b, s:e] = v[0]
    return chosen, top_ids, top_logprobs
