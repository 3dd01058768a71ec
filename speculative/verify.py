"""The acceptance rules of speculative verification, greedy and sampled, exact in both modes,
on the device with no host synchronisation. The distributions and random numbers they use come
from sampling.py."""

import torch

from speculative.draft_tree import chain_path, sibling_node
from speculative.sampling import ACCEPT_STREAM, SAMPLE_STREAM, SIBLING_STREAM, sample, uniform


def verify_greedy(
    target_ids: torch.Tensor,
    drafts: torch.Tensor,
    siblings: torch.Tensor | None = None,
    draft_limit: torch.Tensor | None = None,
) -> tuple:
    """target_ids [B, T] the target's argmax at every node of the draft tree
    (speculative/draft_tree.py; T = K+1 for a chain), drafts [B, K] the chain, siblings [B, M, K] or
    None -> (tokens [B, K+1], num_emitted [B], path [B, K+1]: the node whose logits chose each
    token). Accept the longest prefix of the chain where draft == target argmax; where it stops
    short of K, the sibling of the first rejected draft that equals the target's token there, if
    any; then the target's token after the last accepted node (bonus). draft_limit [B] or None:
    each row's own K (`capped`)."""
    B, K = drafts.shape
    accepted = (drafts == target_ids[:, :K]).int().cumprod(-1).sum(-1)
    accepted, limit = capped(accepted, draft_limit, K)
    tokens = target_ids[:, : K + 1]
    if siblings is None:
        return tokens, accepted + 1, chain_path(B, K, drafts.device)
    rows = torch.arange(B, device=drafts.device)
    depth = accepted.clamp(max=K - 1)  # of the first rejected draft, from 0
    hit = (siblings[rows, :, depth] == target_ids[rows, accepted].unsqueeze(1)) & (
        accepted < limit
    ).unsqueeze(1)
    node = sibling_node(K, hit.int().argmax(1), depth)
    return _through_sibling(
        tokens, accepted, hit.any(1), node, target_ids[rows, accepted], target_ids[rows, node]
    )


def capped(accepted: torch.Tensor, draft_limit: torch.Tensor | None, K: int) -> tuple:
    """A row whose request verifies only its first k drafts (per-request K) accepts at most k,
    and its draft k is not rejected but never proposed: the token there comes from the target's
    whole distribution, as verification with K = k gives. -> (accepted [B], the limit [B] or K)."""
    if draft_limit is None:
        return accepted, K
    return torch.minimum(accepted, draft_limit), draft_limit


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
    draft_limit: torch.Tensor | None = None,
) -> tuple:
    """probs [B, T, V] target distributions at every node of the draft tree, drafts [B, K] the chain
    (greedy drafts: q is one-hot), u_accept [B, K] and u_sample [B, K+1] uniforms per position;
    siblings [B, M, K] with u_sibling [B, M, K], or None -> (tokens [B, K+1], num_emitted [B], path
    [B, K+1]). The bonus token after `a` accepted drafts draws with u_sample[:, a], the uniform of
    its position. Draft x is accepted with probability p(x); on rejection, x is removed from p
    (max(p - q, 0) for one-hot q) and the siblings at that depth are tried in turn the same way
    against what is left, each accepted with its renormalised probability and removed when rejected;
    then a token is drawn from the remainder. After an accepted sibling the bonus is drawn from p at
    the sibling's node. The result is distributed exactly as p. draft_limit: as in
    `verify_greedy`."""
    B, K = drafts.shape
    p_draft = probs[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
    accepted = (u_accept < p_draft).int().cumprod(-1).sum(-1)  # [B]
    accepted, limit = capped(accepted, draft_limit, K)
    rows = torch.arange(B, device=probs.device)
    residual = probs[rows, accepted]  # [B, V]
    if K > 0:
        rejected = drafts.gather(1, accepted.clamp(max=K - 1).unsqueeze(1)).squeeze(1)
        keep = torch.where(accepted < limit, 0.0, 1.0).to(residual.dtype)
        residual = residual.scatter(
            1, rejected.unsqueeze(1), (residual[rows, rejected] * keep).unsqueeze(1)
        )
    if siblings is not None:
        depth = accepted.clamp(max=K - 1)
        trying = accepted < limit
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


def verify_seeded(probs, drafts, siblings, seeds, chain_positions, draft_limit=None) -> tuple:
    """`verify_sampled` with each request's counter-based uniforms: seeds [B], the chain's
    positions [B, K+1] (the pending token's first); the other arguments as there."""
    u_sibling = None
    if siblings is not None:
        M = siblings.shape[1]
        streams = [uniform(seeds, chain_positions[:, 1:], SIBLING_STREAM + m) for m in range(M)]
        u_sibling = torch.stack(streams, 1)
    u_accept = uniform(seeds, chain_positions[:, 1:], ACCEPT_STREAM)
    u_sample = uniform(seeds, chain_positions + 1, SAMPLE_STREAM)
    return verify_sampled(probs, drafts, u_accept, u_sample, siblings, u_sibling, draft_limit)
