"""Mixture-of-experts layers: the router, the experts (this rank's slice of every expert), and
the loop over experts that is the CPU path and the reference of the fused kernel.

Tensor parallelism splits each expert along its intermediate dimension, as the dense MLP is split:
every rank holds a slice of gate, up and down of every expert, computes every routed token's
partial down projection, and one all-reduce sums them. The router is replicated. On CUDA the
experts run in workers/layers/fused_moe.py's two Triton launches (graph-capturable); elsewhere
in the loop below, which reads the chosen experts back to the host."""

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.activation import swiglu
from workers.layers.fp8 import FP8, quantize_rows
from workers.layers.parallel import all_reduce, check_shape, row_scales, tp_rank_size


def route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]): softmax
    in float32 over all experts, the top k, renormalized to sum to one if asked (Mixtral,
    Qwen3-MoE), as transformers routes."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scale) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w)
    return (F.linear(x.float(), w.float()) * scale).to(x.dtype)  # FP8: exact products


def moe_reference(
    x, w13, w2, route_weights, topk_ids, w13_scale=None, w2_scale=None, b13=None, limit=None
):
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] (FP8 with scales [E, 2I]
    and [E, H], or x's dtype); route_weights, topk_ids [T, k] -> [T, H]: per expert any token
    chose, a gather, two matmuls and a weighted scatter-add, summed in float32. b13 [E, 2I]: the
    gate and up biases; limit: `swiglu`'s."""
    out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        s13, s2 = (None if s is None else s[expert] for s in (w13_scale, w2_scale))
        gate_up = _expert_linear(x[token], w13[expert], s13)
        if b13 is not None:
            gate_up = gate_up + b13[expert]
        down = _expert_linear(swiglu(gate_up, limit), w2[expert], s2).float()
        out.index_add_(0, token, down * route_weights[token, slot, None].float())
    return out.to(x.dtype)


class Router(nn.Module):
    """A replicated linear layer kept in the model's dtype (never FP8): [T, H] -> [T, out]."""

    def __init__(self, hidden: int, out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def load_full(self, full, index: int = 0, name: str = "weight", what: str = "tensor"):
        param = getattr(self, name)
        check_shape(full, param.shape, what)
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ExpertWeights(nn.Module):
    """One projection of every expert, [E, out, in], this rank's slice of it: `parts` fused
    sub-matrices split by rows (gate and up: parts 2), or split by columns (down). A checkpoint
    tensor loads as part `index` = expert * parts + part. FP8 keeps a scale per expert and row.
    A bias [E, out] (gpt-oss) is split as the rows are, or whole where the columns are split (the
    caller adds it once, after the all-reduce)."""

    def __init__(
        self, experts: int, out: int, inp: int, parts: int, split_rows: bool, group, bias=False
    ):
        super().__init__()
        self.rank, self.tp = tp_rank_size(group)
        cut = out // parts if split_rows else inp
        if cut % self.tp:
            raise ValueError(
                f"expert size {cut} is not divisible by tensor-parallel size {self.tp}"
            )
        self.parts, self.split_rows = parts, split_rows
        shape = (experts, out // self.tp, inp) if split_rows else (experts, out, inp // self.tp)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.register_parameter("weight_scale", None)
        self.bias = nn.Parameter(torch.zeros(shape[:2]), requires_grad=False) if bias else None
        self.num_parts = experts * parts  # checkpoint tensors per parameter

    def use_fp8(self, quantize: bool) -> None:
        E, N, K = self.weight.shape
        if quantize:
            weight, scale = quantize_rows(self.weight.data.reshape(E * N, K))
            weight, scale = weight.view(E, N, K), scale.view(E, N)
        else:
            weight = torch.empty_like(self.weight, dtype=FP8)
            scale = torch.ones(E, N, device=weight.device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def load_full(self, full, index: int = 0, name: str = "weight", what: str = "tensor"):
        expert, part = divmod(index, self.parts)
        rows = self.weight.shape[1] // self.parts  # this rank's rows of one part
        dest = getattr(self, name).data[expert]
        if name == "bias" and not self.split_rows:
            check_shape(full, dest.shape, what)
            dest.copy_(full)
        elif self.split_rows:
            dest = dest[part * rows : (part + 1) * rows]
            if name == "weight_scale":
                full = row_scales(full, rows * self.tp, what)
            check_shape(full, (rows * self.tp, *dest.shape[1:]), what)
            dest.copy_(full.narrow(0, self.rank * rows, rows))
        elif name == "weight_scale":
            dest.copy_(row_scales(full, dest.shape[0], what))
        else:
            local = dest.shape[1]
            check_shape(full, (dest.shape[0], local * self.tp), what)
            dest.copy_(full.narrow(1, self.rank * local, local))


class Experts(nn.Module):
    """The experts of one layer: x [T, H], the routing [T, k] -> sum of each token's experts'
    SwiGLU outputs, weighted, all-reduced over the TP group. gpt-oss: biases, and the clamped
    SwiGLU (`limit`)."""

    def __init__(self, num_experts, hidden, intermediate, group=None, bias=False, limit=None):
        super().__init__()
        self.group, self.limit = group, limit
        self.gate_up = ExpertWeights(num_experts, 2 * intermediate, hidden, 2, True, group, bias)
        self.down = ExpertWeights(num_experts, hidden, intermediate, 1, False, group, bias)

    def forward(self, x, route_weights, topk_ids) -> torch.Tensor:
        args = (self.gate_up.weight, self.down.weight, route_weights, topk_ids)
        args += (self.gate_up.weight_scale, self.down.weight_scale, self.gate_up.bias, self.limit)
        if x.device.type == "cuda":  # Triton: a GPU install's package
            from workers.layers.fused_moe import fused_moe

            out = fused_moe(x, *args)
        else:
            out = moe_reference(x, *args)
        out = all_reduce(out, self.group)
        if self.down.bias is not None:  # each chosen expert's, weighted: once, past the sum
            bias = self.down.bias[topk_ids].float() * route_weights.unsqueeze(-1).float()
            out = out + bias.sum(1).to(out.dtype)
        return out
