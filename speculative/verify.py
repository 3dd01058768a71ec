"""Verification and sampling on the device, exact in both modes, with no host synchronisation.

Randomness is counter based: a uniform number is a hash of (request seed, token position, stream),
so every TP rank draws the same numbers, a request's draws do not depend on its batch, and a
seeded request is reproducible.
"""
import torch

ACCEPT_STREAM, SAMPLE_STREAM = 1, 2
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


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, T, V] float32, per-row params [B] -> the distribution to sample from, [B, T, V]:
    temperature, min-p, top-k, top-p (vLLM's order). Greedy rows (temperature 0) become one-hot at the
    argmax, so one rule serves both modes."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).view(-1, 1, 1)
    if min_p is not None:  # tokens less likely than min_p x the likeliest one's probability; min_p 0 cuts none
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p.view(-1, 1, 1) * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k is not None:
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(-1, 1, 1), one_hot, probs)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    k = torch.where(top_k > 0, top_k, V).view(-1, 1, 1)
    # top-k first, then top-p on the renormalised survivors (the Hugging Face / vLLM order)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))   # [B, T, V]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    # keeps the smallest prefix with mass >= top_p; top_p 1 cuts nothing (in float32 the mass
    # reaches 1.0 before the tail, and that row's distribution must not depend on other rows)
    cut = (mass_before >= top_p.view(-1, 1, 1)) & (top_p < 1).view(-1, 1, 1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], counts [B, T, V] of each token in the output before each position, per-row
    penalties [B] -> OpenAI's penalised logits."""
    return logits - frequency.view(-1, 1, 1) * counts - presence.view(-1, 1, 1) * (counts > 0)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """logits [B, T, V], tokens [B, T] -> the tokens' log-probabilities [B, T], and the ids and
    log-probabilities of the num_top most likely tokens [B, T, num_top]: the model's own distribution,
    before temperature, top-k and top-p (what vLLM reports by default)."""
    logp = logits.float().log_softmax(-1)
    top = logp.topk(num_top, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), top.indices, top.values


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [N, V] (need not be normalised), u [N] in [0, 1) -> ids [N]."""
    cdf = probs.cumsum(-1)
    ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def verify_greedy(target_ids: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, K+1] argmax at each position, drafts [B, K] -> (tokens [B, K+1], num_emitted [B]).
    Accept the longest prefix where draft == target argmax, then the target's token (bonus)."""
    accepted = (drafts == target_ids[:, :-1]).int().cumprod(-1).sum(-1)
    return target_ids, accepted + 1


def verify_sampled(probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                   u_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [B, K+1, V] target distributions, drafts [B, K] (greedy drafts: q is one-hot),
    u_accept [B, K] and u_sample [B, K+1] uniforms per position -> (tokens [B, K+1], num_emitted [B]).
    The bonus token after `a` accepted drafts draws with u_sample[:, a], the uniform of its position.
    Draft x is accepted with probability p(x); on rejection the token is drawn from p with x removed
    and renormalised (max(p - q, 0) for one-hot q). The result is distributed exactly as p."""
    B, K = drafts.shape
    p_draft = probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    accepted = (u_accept < p_draft).int().cumprod(-1).sum(-1)            # [B]
    rows = torch.arange(B, device=probs.device)
    residual = probs[rows, accepted]                                      # [B, V]
    if K > 0:
        rejected = drafts.gather(1, accepted.clamp(max=K - 1).unsqueeze(1)).squeeze(1)
        keep = torch.where(accepted < K, 0.0, 1.0).to(residual.dtype)
        residual = residual.scatter(1, rejected.unsqueeze(1), (residual[rows, rejected] * keep).unsqueeze(1))
    bonus = sample(residual, u_sample[rows, accepted])
    padded = torch.cat([drafts, bonus.unsqueeze(1)], dim=1)
    j = torch.arange(K + 1, device=probs.device)
    tokens = torch.where(j < accepted.unsqueeze(1), padded, bonus.unsqueeze(1))
    return tokens, accepted + 1
