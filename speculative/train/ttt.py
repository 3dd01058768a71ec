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
    0..depth concatenated. Block 0: key s <= t - depth. Block i >= 1: only key
    s == t - depth + i."""
    t = torch.arange(T, device=device).view(T, 1)
    s = torch.arange(T, device=device).view(1, T)
    blocks = [s <= t - depth] + [s == t - depth + i for i in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


def _layer(
    drafter: Eagle3Drafter, embeds, hidden, positions, keys: list, values: list
) -> torch.Tensor:
    """One midlayer forward at depth len(keys); appends this depth's keys/values to the lists."""
    layer = drafter.midlayer
    attn = layer.self_attn
    B, T, _ = embeds.shape
    D, heads, kv_heads = attn.head_dim, attn.heads, attn.kv_heads
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
    q, k, v = attn.qkv_proj(x).split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q = attn.rotary(q.view(B, T, heads, D), positions).transpose(1, 2)  # [B, heads, T, D]
    # [B, kv_heads, T, D]
    keys.append(attn.rotary(k.view(B, T, kv_heads, D), positions).transpose(1, 2))
    values.append(v.view(B, T, kv_heads, D).transpose(1, 2))
    depth = len(keys) - 1
    # [B, heads, (depth+1)T, D]
    all_keys = torch.cat(keys, dim=2).repeat_interleave(heads // kv_heads, dim=1)
    all_values = torch.cat(values, dim=2).repeat_interleave(heads // kv_heads, dim=1)
    mask = ttt_mask(T, depth, embeds.device)  # [T, (depth+1)T]
    # [B, heads, T, D]
    out = F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=mask)
    h = hidden + attn.o_proj(out.transpose(1, 2).reshape(B, T, heads * D))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def ttt_forward(
    drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, num_steps: int
) -> list[torch.Tensor]:
    """ids [B, T], aux [B, T, 3H_target] -> per depth the drafter's final normed hidden [B, T, H]
    (the LM head's input); the row at t predicts x[t+2]. Rows t < depth have no chain start and
    are to be masked by the caller."""
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    embeds = drafter.embed_tokens(ids.roll(-1, dims=1))  # [B, T, H] token x[t+1] at row t
    hidden = drafter.fc(aux)  # [B, T, H]
    keys, values, outputs = [], [], []
    for _ in range(num_steps):
        h = _layer(drafter, embeds, hidden, positions, keys, values)
        outputs.append(drafter.norm(h))
        hidden = F.pad(h[:, :-1], (0, 0, 1, 0))  # row t gets the output at t-1
    return outputs


def loss_rows(lengths: torch.Tensor, prompt_lens: torch.Tensor, T: int, prompt_weight: float = 0.0):
    """The rows t of a [B, T] batch that the loss reads, as flat indices, and their weights: rows
    where x[t+2] exists, weighing 1 where x[t+1] is a response token and `prompt_weight` inside the
    prompt (the prompt is the target's context, not its output, but it is data the drafter otherwise
    never learns from). Prompt rows and padding, often most of a batch, are skipped."""
    B = len(lengths)
    t = torch.arange(T, device=lengths.device).view(1, T)
    exists = t + 2 <= lengths.view(B, 1) - 1
    is_response = t + 1 >= prompt_lens.view(B, 1)
    weight = (
        (exists & is_response).float() + prompt_weight * (exists & ~is_response).float()
    ).flatten()
    rows = weight.nonzero().squeeze(1)
    return rows, weight[rows]


def ttt_loss(
    hiddens: list[torch.Tensor],
    head,
    probs: torch.Tensor,
    is_in_draft: torch.Tensor,
    rows: torch.Tensor,
    row_weight: torch.Tensor,
    decay: float,
):
    """Soft cross-entropy of each depth's draft distribution (`head` applied to `hiddens` at the
    `rows` from `loss_rows`) against the target's draft-vocab distribution at t+1, `probs`
    [len(rows), Vd], weighted decay**depth, over the rows whose target argmax is draftable
    (`is_in_draft`) and whose chain start t - depth >= 0. Each depth's sum is divided by its number
    of rows of weight > 0. Returns (loss, per-depth accuracy over those rows)."""
    t = rows % hiddens[0].shape[1]
    target_ids = probs.argmax(-1)
    total, accuracies = 0.0, []
    for depth, hidden in enumerate(hiddens):
        w = row_weight * is_in_draft * (t >= depth)
        count = (w > 0).sum().clamp(min=1)
        logits = head(hidden.flatten(0, 1)[rows]).float()  # [rows, Vd]
        ce = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1)
        total = total + decay**depth * (w * ce).sum() / count
        accuracies.append(((logits.argmax(-1) == target_ids) & (w > 0)).sum() / count)
    return total, torch.stack(accuracies)
