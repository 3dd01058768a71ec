"""Training-time test (TTT): the drafter unrolled for several draft steps as at inference, with
each step's hidden input being the drafter's own output of the previous step.

Absolute positions t throughout. At every depth j, the row at position t takes the token x[t+1]
and predicts x[t+2] (the target's distribution at t+1). Depth 0 takes `fc(aux[t])` as its hidden
input. Depth j >= 1 models draft forward j+1 of a chain that started at p = t - j: its hidden input
is the depth j-1 output at t-1, and (as the drafter KV cache holds at inference) it attends to the
depth-0 keys at positions <= t-j plus the chain keys of depths 1..j at positions t-j+1..t.
"""
import torch
import torch.nn.functional as F

from speculative.drafter import Eagle3Drafter


def ttt_mask(T: int, depth: int, device) -> torch.Tensor:
    """Which keys a depth-`depth` query may read: [T, (depth+1) * T] bool over the keys of depths
    0..depth concatenated. Block 0: key s <= t - depth. Block i >= 1: only key s == t - depth + i."""
    t = torch.arange(T, device=device).view(T, 1)
    s = torch.arange(T, device=device).view(1, T)
    blocks = [s <= t - depth] + [s == t - depth + i for i in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


def _layer(drafter: Eagle3Drafter, embeds, hidden, positions, keys: list, values: list) -> torch.Tensor:
    """One midlayer forward at depth len(keys); appends this depth's keys/values to the lists."""
    layer = drafter.midlayer
    attn = layer.self_attn
    B, T, _ = embeds.shape
    D, heads, kv_heads = attn.head_dim, attn.heads, attn.kv_heads
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
    q, k, v = attn.qkv_proj(x).split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = attn.rotary(q.view(B, T, heads, D), positions).transpose(1, 2)                 # [B, heads, T, D]
    keys.append(attn.rotary(k.view(B, T, kv_heads, D), positions).transpose(1, 2))     # [B, kv_heads, T, D]
    values.append(v.view(B, T, kv_heads, D).transpose(1, 2))
    depth = len(keys) - 1
    all_keys = torch.cat(keys, dim=2).repeat_interleave(heads // kv_heads, dim=1)      # [B, heads, (depth+1)T, D]
    all_values = torch.cat(values, dim=2).repeat_interleave(heads // kv_heads, dim=1)
    mask = ttt_mask(T, depth, embeds.device)                                           # [T, (depth+1)T]
    out = F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=mask)      # [B, heads, T, D]
    h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, heads * D))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_forward(drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """ids [B, T], aux [B, T, 3H_target] -> per depth the draft-vocab logits [B, T, Vd]; the row at
    t predicts x[t+2]. Rows t < depth have no chain start and are to be masked by the caller."""
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    embeds = drafter.embed_tokens(ids.roll(-1, dims=1))      # [B, T, H] token x[t+1] at row t
    hidden = drafter.fc(aux)                                 # [B, T, H]
    keys, values, logits = [], [], []
    for _ in range(num_steps):
        h = _layer(drafter, embeds, hidden, positions, keys, values)
        logits.append(drafter.lm_head(drafter.norm(h)))
        hidden = F.pad(h[:, :-1], (0, 0, 1, 0))              # row t gets the output at t-1
    return logits


def ttt_loss(logits: list[torch.Tensor], target_probs: torch.Tensor, is_in_draft: torch.Tensor,
             lengths: torch.Tensor, prompt_lens: torch.Tensor, decay: float, prompt_weight: float = 0.0):
    """Soft cross-entropy of each depth against the target's draft-vocab distribution at t+1,
    weighted decay**depth, over rows t where x[t+2] exists, the target's argmax is draftable and
    the chain start t - depth >= 0. Rows where x[t+1] is a response token weigh 1, rows inside the
    prompt `prompt_weight` (the prompt is the target's context, not its output, but it is data the
    drafter otherwise never learns from). The sum is divided by the number of rows of weight > 0.
    target_probs [B, T, Vd] (at position t), is_in_draft [B, T]. Returns (loss, per-depth accuracy
    over the rows of weight > 0)."""
    B, T, _ = target_probs.shape
    t = torch.arange(T, device=target_probs.device).view(1, T)
    probs_next = target_probs.roll(-1, dims=1)                               # [B, T, Vd] at t+1
    usable = (t + 2 <= lengths.view(B, 1) - 1) & is_in_draft.roll(-1, dims=1)  # [B, T]
    is_response = t + 1 >= prompt_lens.view(B, 1)
    weight = (usable & is_response).float()
    if prompt_weight > 0:
        weight = weight + prompt_weight * (usable & ~is_response).float()
    target_ids = probs_next.argmax(-1)
    total, accuracies = 0.0, []
    for depth, depth_logits in enumerate(logits):
        w = weight * (t >= depth)
        counted = (w > 0).float()
        count = counted.sum().clamp(min=1)
        ce = -(probs_next * torch.log_softmax(depth_logits.float(), dim=-1)).sum(-1)  # [B, T]
        total = total + decay ** depth * (ce * w).sum() / count
        accuracies.append(((depth_logits.argmax(-1) == target_ids).float() * counted).sum() / count)
    return total, torch.stack(accuracies)
