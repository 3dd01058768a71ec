"""Tensor-parallel building blocks (Megatron style). The TP group is passed in; None means TP=1.

Each parallel layer owns only its shard and knows how to cut that shard out of a full
checkpoint tensor (`load_full`), so loaders never need to know about sharding. The linear layers
may hold FP8 weights with a scale per output row (`use_fp8`, workers/layers/fp8.py): the scales
shard with their rows in column-parallel layers and are whole on every rank of a row-parallel one.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.layers.fp8 import FP8, fp8_linear, quantize_rows


def tp_rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_shape(full: torch.Tensor, expected, what: str) -> None:
    """Every `load_full` checks the whole (unsharded) tensor first: narrow() and copy_() would
    silently drop extra rows or columns and broadcast a size-1 tensor."""
    if tuple(full.shape) != tuple(expected):
        raise ValueError(
            f"{what} has shape {list(full.shape)}, but config.json implies {list(expected)}"
        )


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def row_scales(full: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A checkpoint's FP8 weight scale as one per row [rows]: per-channel ([rows] or [rows, 1],
    as compressed-tensors writes it) or per-tensor (one number, repeated)."""
    if full.numel() == 1:
        return full.reshape(()).expand(rows)
    if tuple(full.shape) not in ((rows,), (rows, 1)):
        raise ValueError(
            f"{what} has shape {list(full.shape)}: a weight scale is one number or one per "
            f"output row ({rows})"
        )
    return full.reshape(rows)


class QuantizableLinear(nn.Module):
    """A linear layer's weight in the model's dtype, or in FP8 with a float32 scale per output
    row once `use_fp8` was called."""

    def __init__(self):
        super().__init__()
        self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # [out] float32 with FP8 weights

    def use_fp8(self, quantize: bool) -> None:
        """FP8 from now on: quantize the weight loaded (quantize=True: each row to its own
        scale), or make room for a checkpoint's FP8 weight and its scale."""
        if quantize:
            weight, scale = quantize_rows(self.weight.data)
        else:
            weight = torch.empty_like(self.weight, dtype=FP8)
            scale = torch.ones(self.weight.shape[0], device=weight.device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
        return fp8_linear(x, self.weight, self.weight_scale, bias)


class ColumnParallelLinear(QuantizableLinear):
    """y = x @ W.T with W split by output rows. `output_sizes` lists fused sub-matrices
    (q, k, v or gate, up), each split separately so every rank holds its slice of each."""

    def __init__(self, in_features: int, output_sizes: list[int], group=None, bias: bool = False):
        super().__init__()
        self.rank, self.tp = tp_rank_size(group)
        for size in output_sizes:
            if size % self.tp:
                raise ValueError(
                    f"output size {size} is not divisible by tensor-parallel size {self.tp}"
                )
        self.output_sizes = [s // self.tp for s in output_sizes]
        self.weight = nn.Parameter(
            torch.empty(sum(self.output_sizes), in_features), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(sum(self.output_sizes)), requires_grad=False) if bias else None
        )

    def load_full(
        self, full: torch.Tensor, index: int = 0, name: str = "weight", what: str = "tensor"
    ) -> None:
        """Copy this rank's slice of sub-matrix `index` out of the full tensor."""
        local = self.output_sizes[index]
        start = sum(self.output_sizes[:index])
        param = getattr(self, name)
        if name == "weight_scale":
            full = row_scales(full, local * self.tp, what)
        check_shape(full, (local * self.tp, *param.shape[1:]), what)
        param.data[start : start + local].copy_(full.narrow(0, self.rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowParallelLinear(QuantizableLinear):
    """y = x @ W.T (+ bias) with W split by input columns; partial sums all-reduced, then the
    bias (whole on every rank) added once."""

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = False):
        super().__init__()
        self.rank, self.tp = tp_rank_size(group)
        if in_features % self.tp:
            raise ValueError(
                f"input size {in_features} is not divisible by tensor-parallel size {self.tp}"
            )
        self.group = group
        self.in_local = in_features // self.tp
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)

    def load_full(
        self, full: torch.Tensor, index: int = 0, name: str = "weight", what: str = "tensor"
    ) -> None:
        if name == "weight_scale":  # one per output row: whole on every rank
            self.weight_scale.data.copy_(row_scales(full, self.weight.shape[0], what))
            return
        if name == "bias":
            check_shape(full, self.bias.shape, what)
            self.bias.data.copy_(full)
            return
        check_shape(full, (self.weight.shape[0], self.in_local * self.tp), what)
        self.weight.data.copy_(full.narrow(1, self.rank * self.in_local, self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self.matmul(x, None), self.group)
        return out if self.bias is None else out + self.bias


class ReplicatedLinear(QuantizableLinear):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load_full(
        self, full: torch.Tensor, index: int = 0, name: str = "weight", what: str = "tensor"
    ) -> None:
        if name == "weight_scale":
            self.weight_scale.data.copy_(row_scales(full, self.weight.shape[0], what))
            return
        check_shape(full, self.weight.shape, what)
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding split by vocabulary rows; each rank looks up its rows, the rest are zero."""

    def __init__(self, vocab_size: int, dim: int, group=None):
        super().__init__()
        self.rank, self.tp = tp_rank_size(group)
        self.group = group
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // self.tp)
        self.vocab_start = self.rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, dim), requires_grad=False)

    def load_full(
        self, full: torch.Tensor, index: int = 0, name: str = "weight", what: str = "tensor"
    ) -> None:
        check_shape(full, (self.vocab_size, self.weight.shape[1]), what)
        rows = full[self.vocab_start : self.vocab_start + self.vocab_local]
        self.weight.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight) * inside.unsqueeze(-1)
        return all_reduce(out, self.group)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary; logits gathered to full width on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return all_gather_last_dim(logits, self.group)[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load_full(
        self, full: torch.Tensor, index: int = 0, name: str = "weight", what: str = "tensor"
    ) -> None:
        check_shape(full, self.weight.shape, what)
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel on CUDA
