"""Attention math over what the KV cache (kv_cache.py) hands it, shared by the target and
the drafter.

A small model's step is bound by how many kernels it runs, not by their work, so each layer keeps
its count low: RoPE tables and the mask are built once per forward, queries and keys are rotated
together, and keys and values are gathered together. The attention itself runs one of two ways:
- GQA: cuDNN's kernel reads the query heads of each KV group itself, from queries strided out of
  the QKV projection, with one mask row per token: no copies around it. Only cuDNN takes a mask
  with GQA, and ModelRunner enables cuDNN only while it captures CUDA graphs.
- Folded: the query heads of a KV group are folded into the query length, so the attention is plain
  multi-head attention over the KV heads, which the memory-efficient kernel runs with a mask; it
  costs copies of the queries, the mask and (for several tokens per row) the output.
Measured in graphs on the H200 (BENCHMARKS.md, answered questions): GQA is 1.2-3.4x faster for
one token per row and for prefills, and for a few tokens per row (the verify pass) while batch x
heads fits in one wave over the SMs; past that, folding packs the rows better and is up to 3x
faster.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers import attention_backend
from workers.layers.kv_cache import ForwardBatch, read_kv, write_kv
from workers.layers.parallel import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    check_shape,
    tp_rank_size,
)
from workers.layers.rotary import Rotary


@dataclass
class AttentionInputs:
    """What every layer of one forward shares: RoPE tables [B, T, 1, D] and the additive mask,
    [B, 1, T, S] for GQA or [B, 1, T * group, S] folded (a row per token and query head of a
    group)."""

    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor | None  # None: the paged kernel masks as it reads
    gqa: bool
    window_bias: torch.Tensor | None = None  # `bias` for sliding-window layers (gpt-oss)


def hidden_keys(batch: ForwardBatch) -> torch.Tensor:
    """[B, T, S]: which of the kv_len keys each token may not see (the chain's causal mask, or
    the draft tree's)."""
    T = batch.positions.shape[1]
    key_pos = torch.arange(batch.kv_len, device=batch.positions.device)
    if batch.tree is None:
        return key_pos.view(1, 1, -1) > batch.positions.unsqueeze(-1)
    node = key_pos.view(1, -1) - batch.write_positions[:, :1]  # [B, S] key row's node
    in_tree = (node >= 0) & (node < T)
    sees = batch.tree[:, node.clamp(0, T - 1)].transpose(0, 1)  # [B, T, S]
    return (node >= 0).unsqueeze(1) & ~(sees & in_tree.unsqueeze(1))


def attention_inputs(
    batch: ForwardBatch,
    attn: "CachedAttention",
    dtype: torch.dtype,
    gqa: bool | None = None,
    window: int | None = None,
) -> AttentionInputs:
    """The forward's RoPE tables and masks; `window`: the sliding-window layers' (gpt-oss)."""
    cos, sin = attn.rotary.tables(batch.positions, dtype)
    B, T = batch.positions.shape
    device = batch.positions.device
    if gqa is None:  # sinks: the folded path (attention_with_sinks)
        gqa = attn.sinks is None and attention_backend.use_gqa(
            device, dtype, B, T, attn.heads, attn.head_dim
        )
    if attention_backend.use_paged_kernel(device, T):  # the kernel masks as it reads
        return AttentionInputs(cos, sin, None, gqa)
    hidden = hidden_keys(batch)
    window_bias = None
    if window is not None:  # keys `window` or more positions back are hidden too
        key_pos = torch.arange(batch.kv_len, device=device)
        far = key_pos.view(1, 1, -1) <= batch.positions.unsqueeze(-1) - window
        window_bias = _mask_bias(hidden | far, attn, gqa, dtype)
    return AttentionInputs(cos, sin, _mask_bias(hidden, attn, gqa, dtype), gqa, window_bias)


def _mask_bias(hidden: torch.Tensor, attn: "CachedAttention", gqa: bool, dtype) -> torch.Tensor:
    """hidden [B, T, S] -> the additive mask, [B, 1, T, S], or folded [B, 1, T * group, S]."""
    B, T, S = hidden.shape
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    bias = bias.masked_fill_(hidden, float("-inf")).unsqueeze(1)
    if gqa:
        return bias
    group = attn.heads // attn.kv_heads
    return bias.unsqueeze(3).expand(B, 1, T, group, S).reshape(B, 1, T * group, S)


def attention_with_sinks(q, k, v, bias, sinks: torch.Tensor) -> torch.Tensor:
    """Folded attention (q [B, KV, T * group, D], k and v [B, KV, S, D], bias [B, 1, T * group, S])
    whose softmax also holds each query head's sink logit (sinks [KV * group]): a key that every
    query sees with no value, as gpt-oss attends."""
    B, KV, rows, D = q.shape
    group = sinks.shape[0] // KV
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * D**-0.5 + bias.float()
    sink = sinks.float().view(KV, 1, group).expand(KV, rows // group, group)
    sink = sink.reshape(1, KV, rows, 1).expand(B, KV, rows, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_kernel(q, pool, batch: ForwardBatch, kv_scale, window: int | None, sinks):
    """The Triton kernel for a row of q's length; draft trees always take paged_attention.py's
    (imported here: Triton only where it runs). window, sinks: CachedAttention's."""
    if batch.tree is None and q.shape[1] > attention_backend.KERNEL_MAX_QUERY:
        from workers.layers.paged_prefill import paged_prefill

        return paged_prefill(q, pool, batch, kv_scale, window, sinks)
    from workers.layers.paged_attention import paged_attention

    return paged_attention(q, pool, batch, kv_scale=kv_scale, window=window, sinks=sinks)


class HeadSinks(nn.Module):
    """gpt-oss's sink logit of each query head, this rank's heads of them."""

    def __init__(self, heads: int, group=None):
        super().__init__()
        self.rank, self.tp = tp_rank_size(group)
        self.weight = nn.Parameter(torch.zeros(heads // self.tp), requires_grad=False)

    def load_full(self, full, index: int = 0, name: str = "weight", what: str = "tensor"):
        n = self.weight.shape[0]
        check_shape(full, (n * self.tp,), what)
        self.weight.data.copy_(full.narrow(0, self.rank * n, n))


class CachedAttention(nn.Module):
    """Attention over the KV cache. Family options: `qkv_bias` (Qwen2's biased q, k and v
    projections), `qk_norm_eps` (Qwen3's RMSNorm over each query and key head before RoPE);
    gpt-oss's `o_bias`, `sliding_window` (keys that many positions back or more are not seen)
    and `sinks`."""

    def __init__(
        self,
        in_features: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        group=None,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        o_bias: bool = False,
        sliding_window: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        _, tp = tp_rank_size(group)
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"tensor-parallel size {tp} must divide the attention heads "
                f"({num_heads} query, {num_kv_heads} key/value)"
            )
        self.heads, self.kv_heads, self.head_dim = num_heads // tp, num_kv_heads // tp, head_dim
        self.qkv_proj = ColumnParallelLinear(
            in_features,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            group,
            bias=qkv_bias,
        )
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, group, bias=o_bias)
        self.sliding_window = sliding_window
        self.sinks = HeadSinks(num_heads, group) if sinks else None
        self.rotary = rotary
        self.cache: torch.Tensor | None = None  # [2, slots + 1, max_len, kv_heads, head_dim]
        self.kv_scale = [1.0, 1.0]  # an FP8 pool's K and V scales (a checkpoint's, or 1.0)

    def rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, in] -> rotated queries and keys [B, T, H + KV, D], values [B, T, KV, D]."""
        B, T, _ = x.shape
        H, KV = self.heads, self.kv_heads
        qkv = self.qkv_proj(x).view(B, T, H + 2 * KV, self.head_dim)
        qk = qkv[:, :, : H + KV]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        return self.rotary.apply(qk, cos, sin), qkv[:, :, H + KV :]

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, inputs: AttentionInputs
    ) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        qk, v = self.rotated_qkv(x, inputs.cos, inputs.sin)
        write_kv(self.cache, batch, qk[:, :, H:], v, self.kv_scale)
        sinks = self.sinks.weight if self.sinks is not None else None
        if attention_backend.use_paged_kernel(x.device, T):
            q = qk[:, :, :H]
            out = paged_kernel(q, self.cache, batch, self.kv_scale, self.sliding_window, sinks)
            return self.o_proj(out.reshape(B, T, H * D))  # out [B, T, H, D]
        kv = read_kv(self.cache, batch, self.kv_scale, x.dtype)  # [2, B, KV, S, D]
        bias = inputs.window_bias if self.sliding_window else inputs.bias
        if inputs.gqa:
            out = F.scaled_dot_product_attention(
                qk[:, :, :H].transpose(1, 2), kv[0], kv[1], attn_mask=bias, enable_gqa=True
            )  # [B, H, T, D]
            return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))
        group = H // KV
        q = qk[:, :, :H].reshape(B, T, KV, group, D).transpose(1, 2).reshape(B, KV, T * group, D)
        if sinks is not None:
            out = attention_with_sinks(q, kv[0], kv[1], bias, sinks)
        else:
            out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=bias)
        # out [B, KV, T * group, D]
        return self.o_proj(out.reshape(B, KV, T, group * D).transpose(1, 2).reshape(B, T, H * D))
