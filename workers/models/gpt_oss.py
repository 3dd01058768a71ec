"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with biases and a learned sink logit per head,
a 128-token sliding window in the layers layer_types names (every other one), and a sparse block
in every layer (top 4 of 32 or 128 experts) with biases and a clamped SwiGLU.

Its checkpoints hold each layer's experts as one tensor: `gate_up_proj` [E, H, 2I] with gate and
up interleaved column by column and `down_proj` [E, I, H] (transformers' bf16 layout), or the
published MXFP4 files' `*_blocks` and `*_scales` with rows as output features, dequantized here
to the model's dtype (no FP4 kernel: `--quantization fp8` then stores them in FP8). The router is
`mlp.router`. `checkpoint_tensors` renames and splits them into the per-expert tensors the loader
reads."""

import re

from workers.models.decoder import DecoderModel
from workers.models.quantization import dequantize_mxfp4
from workers.models.sparse_moe import MoeDecoderLayer

FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


class GptOss(DecoderModel):
    layer_class = MoeDecoderLayer

    @staticmethod
    def checkpoint_tensors(tensors):
        """(name, tensor) as the checkpoint holds them -> as load_weights reads them."""
        halves = {}  # an MXFP4 tensor's blocks or scales, until the other comes
        for name, tensor in tensors:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            fused = FUSED_EXPERTS.fullmatch(name)
            if name.endswith(".self_attn.sinks"):
                yield f"{name}.weight", tensor
            elif fused is None:
                yield name, tensor
            elif fused[3] == "_bias":
                yield from _per_expert(fused[1], fused[2], tensor, "bias")
            elif fused[3] is None:  # [E, in, out] -> [E, out, in]
                yield from _per_expert(fused[1], fused[2], tensor.transpose(1, 2), "weight")
            elif (fused[1], fused[2]) not in halves:
                halves[fused[1], fused[2]] = (fused[3], tensor)
            else:
                kind, other = halves.pop((fused[1], fused[2]))
                blocks, scales = (tensor, other) if fused[3] == "_blocks" else (other, tensor)
                weight = dequantize_mxfp4(blocks, scales)
                yield from _per_expert(fused[1], fused[2], weight, "weight")
        if halves:
            raise ValueError(f"MXFP4 tensors without their blocks or scales: {sorted(halves)}")


def _per_expert(prefix: str, projection: str, tensor, param: str):
    """One layer's experts' weights [E, out, in] (or biases [E, out]) -> each expert's gate, up
    (the even and odd rows of gate_up) and down."""
    if projection == "down_proj":
        parts = {"down_proj": tensor}
    else:
        parts = {"gate_proj": tensor[:, 0::2], "up_proj": tensor[:, 1::2]}
    for expert in range(tensor.shape[0]):
        for part, values in parts.items():
            yield f"{prefix}.{expert}.{part}.{param}", values[expert]
