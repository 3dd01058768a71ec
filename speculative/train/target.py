"""The frozen target over whole sequences, without a KV cache: aux features and the target's
distribution over the draft vocabulary, recomputed for every training batch (never stored)."""

import torch
import torch.nn.functional as F

from workers.layers.attention import CachedAttention
from workers.models import DecoderModel


def _causal_attention(
    attn: CachedAttention, x: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    B, T, _ = x.shape
    H, D = attn.heads, attn.head_dim
    qk, v = attn.rotated_qkv(x, *attn.rotary.tables(positions, x.dtype))
    q = qk[:, :, :H].transpose(1, 2)  # [B, heads, T, D]
    k = qk[:, :, H:].transpose(1, 2)  # [B, kv_heads, T, D]
    v = v.transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=attn.heads != attn.kv_heads
    )
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, attn.heads * D))


@torch.no_grad()
def target_features(model: DecoderModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (right padded) -> final normed hidden [B, T, H], aux features [B, T, 3H]: the
    residual stream entering each aux layer, exactly what `DecoderModel.forward` captures at
    inference."""
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    h = model.embed_tokens(ids)
    aux = {}
    for i, layer in enumerate(model.layers):
        if i in model.aux_layer_ids:
            aux[i] = h
        h = h + _causal_attention(layer.self_attn, layer.input_layernorm(h), positions)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h), torch.cat([aux[i] for i in model.aux_layer_ids], dim=-1)


@torch.no_grad()
def target_draft_probs(
    model: DecoderModel, hidden: torch.Tensor, draft_to_target: torch.Tensor, chunk: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] -> (probs [N, Vd] float32: the target's distribution renormalised over the
    draft vocabulary, is_in_draft [N]: whether the target's full-vocab argmax is a draft token).
    Positions whose argmax is outside the draft vocabulary cannot be drafted; training skips
    them."""
    weight = model.lm_head.weight
    in_draft = torch.zeros(weight.shape[0], dtype=torch.bool, device=hidden.device)
    in_draft[draft_to_target] = True
    probs, is_in_draft = [], []
    for part in hidden.split(chunk):  # full-vocab logits only a chunk at a time
        logits = F.linear(part, weight)  # [n, V]
        is_in_draft.append(in_draft[logits.argmax(-1)])
        probs.append(torch.softmax(logits[:, draft_to_target].float(), dim=-1))
    return torch.cat(probs), torch.cat(is_in_draft)
