"""Verification and sampling on the device, exact in both modes, with no host synchronisation.

Randomness is counter based: a uniform number is a hash of (request seed, token position, stream),
so every TP rank draws the same numbers, a request's draws do not depend on its batch, and a
seeded request is reproducible.
"""

import torch

from speculative.draft_tree import chain_path, sibling_node

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
    temperature, min-p, top-k, top-p (vLLM's order). Greedy rows (temperature 0) become one-hot at the
    argmax, so one rule serves both modes."""
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
    penalties [B], in_prompt [B, V] -> the penalised logits: vLLM's repetition penalty over the tokens
    of the prompt and the output, then OpenAI's frequency and presence penalties over the output."""
    seen = (counts > 0) | in_prompt.unsqueeze(1)
    r = torch.where(seen, repetition.view(-1, 1, 1), 1.0)
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency.view(-1, 1, 1) * counts - presence.view(-1, 1, 1) * (counts > 0)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, ...]:
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


def verify_greedy(
    target_ids: torch.Tensor, drafts: torch.Tensor, siblings: torch.Tensor | None = None
) -> tuple:
    """target_ids [B, T] the target's argmax at every node of the draft tree (speculative/draft_tree.py;
    T = K+1 for a chain), drafts [B, K] the chain, siblings [B, M, K] or None -> (tokens [B, K+1],
    num_emitted [B], path [B, K+1]: the node whose logits chose each token).
    Accept the longest prefix of the chain where draft == target argmax; where it stops short of K,
    the sibling of the first rejected draft that equals the target's token there, if any; then the
    target's token after the last accepted node (bonus)."""
    B, K = drafts.shape
    accepted = (drafts == target_ids[:, :K]).int().cumprod(-1).sum(-1)
    tokens = target_ids[:, : K + 1]
    if siblings is None:
        return tokens, accepted + 1, chain_path(B, K, drafts.device)
    rows = torch.arange(B, device=drafts.device)
    depth = accepted.clamp(max=K - 1)  # of the first rejected draft, from 0
    hit = (siblings[rows, :, depth] == target_ids[rows, accepted].unsqueeze(1)) & (
        accepted < K
    ).unsqueeze(1)
    node = sibling_node(K, hit.int().argmax(1), depth)
    return _through_sibling(
        tokens, accepted, hit.any(1), node, target_ids[rows, accepted], target_ids[rows, node]
    )


def _through_sibling(tokens, accepted, found, node, sibling, bonus) -> tuple:
    """The chain's result tokens [B, K+1] after `accepted` drafts [B], extended in the rows where a
    sibling was accepted (found [B]; its node [B] and token `sibling` [B]; `bonus` [B], the token
    after it) -> (tokens, num_emitted, path)."""
    B, K = tokens.shape[0], tokens.shape[1] - 1
    rows = torch.arange(B, device=tokens.device)
    tokens, path = tokens.clone(), chain_path(B, K, tokens.device).clone()
    at, after = accepted.clamp(max=K), (accepted + 1).clamp(max=K)
    tokens[rows, at] = torch.where(found, sibling, tokens[rows, at])
    tokens[rows, after] = torch.where(found, bonus, tokens[rows, after])
    path[rows, after] = torch.where(found, node, path[rows, after])
    return tokens, accepted + 1 + found.long(), path


def verify_sampled(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    siblings: torch.Tensor | None = None,
    u_sibling: torch.Tensor | None = None,
) -> tuple:
    """probs [B, T, V] target distributions at every node of the draft tree, drafts [B, K] the chain
    (greedy drafts: q is one-hot), u_accept [B, K] and u_sample [B, K+1] uniforms per position;
    siblings [B, M, K] with u_sibling [B, M, K], or None -> (tokens [B, K+1], num_emitted [B], path [B, K+1]).
    The bonus token after `a` accepted drafts draws with u_sample[:, a], the uniform of its position.
    Draft x is accepted with probability p(x); on rejection, x is removed from p (max(p - q, 0) for
    one-hot q) and the siblings at that depth are tried in turn the same way against what is left,
    each accepted with its renormalised probability and removed when rejected; then a token is drawn
    from the remainder. After an accepted sibling the bonus is drawn from p at the sibling's node.
    The result is distributed exactly as p."""
    B, K = drafts.shape
    p_draft = probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    accepted = (u_accept < p_draft).int().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(B, device=probs.device)
    residual = probs[rows, accepted]  # [B, V]
    if K > 0:
        rejected = drafts.gather(1, accepted.clamp(max=K - 1).unsqueeze(1)).squeeze(1)
        keep = torch.where(accepted < K, 0.0, 1.0).to(residual.dtype)
        residual = residual.scatter(
            1, rejected.unsqueeze(1), (residual[rows, rejected] * keep).unsqueeze(1)
        )
    if siblings is not None:
        depth = accepted.clamp(max=K - 1)
        trying = accepted < K
        found = torch.zeros_like(trying)
        m_found = torch.zeros_like(accepted)
        for m in range(siblings.shape[1]):
            x = siblings[rows, m, depth]
            px = residual[rows, x]
            take = trying & (u_sibling[rows, m, depth] * residual.sum(-1) < px)
            found, m_found = found | take, torch.where(take, m, m_found)
            trying = trying & ~take
            residual = residual.scatter(
                1, x.unsqueeze(1), torch.where(trying, 0.0, px).unsqueeze(1)
            )
    bonus = sample(residual, u_sample[rows, accepted])
    padded = torch.cat([drafts, bonus.unsqueeze(1)], dim=1)
    j = torch.arange(K + 1, device=probs.device)
    tokens = torch.where(j < accepted.unsqueeze(1), padded, bonus.unsqueeze(1))
    if siblings is None:
        return tokens, accepted + 1, chain_path(B, K, probs.device)
    node = sibling_node(K, m_found, depth)
    after = sample(probs[rows, node], u_sample[rows, (accepted + 1).clamp(max=K)])
    return _through_sibling(tokens, accepted, found, node, siblings[rows, m_found, depth], after)
