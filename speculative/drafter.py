"""The EAGLE-3 drafter model: one Llama-style layer over [token embedding ; hidden], with `fc`
reducing the target's auxiliary features and a draft vocabulary mapped to the target's by d2t.
Its checkpoint format lives in drafter_format.py."""

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.layers.attention import CachedAttention, attention_inputs
from workers.layers.kv_cache import ForwardBatch
from workers.layers.parallel import (
    ParallelLMHead,
    ReplicatedLinear,
    RMSNorm,
    VocabParallelEmbedding,
)
from workers.layers.rotary import Rotary
from workers.models.config import rope_parameters
from workers.models.decoder import MLP


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default (2, L/2, L-3)
    # the drafter's own RoPE (the published Llama 3.x heads: theta 10000, no scaling, while their
    # targets scale); its max_position_embeddings is not read: the target's context is served
    rope_scaling: dict | None = field(default=None, compare=False)
    norm_before_residual: bool = False  # speculators' flag: the residual is the normed hidden

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                "EAGLE-3 drafters have num_hidden_layers 1, "
                f"this config has {cfg['num_hidden_layers']}"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"{key} is set; drafter layers with biases are not supported")
        theta, rope = rope_parameters(cfg, ValueError)
        heads = cfg["num_attention_heads"]
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            aux_layer_ids=tuple(aux) if aux else None,
            rope_scaling=rope,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        )

    def to_hf(self) -> dict:
        cfg = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        if self.aux_layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling
        if self.norm_before_residual:
            cfg["norm_before_residual"] = True
        return cfg


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig, rotary: Rotary, group=None):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = CachedAttention(
            2 * H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rotary, group
        )
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size, group)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, batch, attention_inputs(batch, self.self_attn, x.dtype))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(
        self,
        cfg: DrafterConfig,
        num_aux: int = 3,
        group=None,
        max_positions: int = 4096,
        embed_tokens: VocabParallelEmbedding | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.rotary = Rotary(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.has_own_embeddings = embed_tokens is None
        self.embed_tokens = embed_tokens or VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, group
        )
        self.fc = ReplicatedLinear(num_aux * cfg.target_hidden_size, cfg.hidden_size)
        self.midlayer = Eagle3Layer(cfg, self.rotary, group)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size, group)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, from_features: bool
    ) -> torch.Tensor:
        """ids [B, T]; hidden [B, T, 3H_target] target features (first draft forward, `fc` applied
        here) or [B, T, H] the drafter's own previous output.
        Returns the pre-norm output [B, T, H]."""
        if from_features:
            hidden = self.fc(hidden)
        return self.midlayer(self.embed_tokens(ids), hidden, batch)

    def propose(self, hidden: torch.Tensor, num: int = 1, allowed=None) -> torch.Tensor:
        """Pre-norm output [B, H] -> the drafter's `num` likeliest tokens, likeliest first, in the
        target vocabulary [B, num]; with `allowed` (a grammar's packed bitmask over the target
        vocabulary [B, W] int32) among the tokens it allows."""
        scores = self._masked(self.lm_head(self.norm(hidden)), allowed)
        draft_ids = _top(scores, num)
        return draft_ids + self.d2t[draft_ids]

    def propose_scored(
        self, hidden: torch.Tensor, num: int = 1, allowed=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm output [B, H] -> (`propose`'s tokens [B, num], the drafter's
        probabilities of them)."""
        probs = self._masked(self.lm_head(self.norm(hidden)).float().softmax(-1), allowed)
        draft_ids = _top(probs, num)
        return draft_ids + self.d2t[draft_ids], probs.gather(-1, draft_ids).clamp(min=0)

    def _masked(self, scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """scores [B, draft vocabulary] with the tokens `allowed` [B, W] forbids at -inf."""
        if allowed is None:
            return scores
        target_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        bits = (allowed[:, target_ids >> 5] >> (target_ids & 31).to(torch.int32)) & 1
        return scores.masked_fill(bits == 0, float("-inf"))


def _top(scores: torch.Tensor, num: int) -> torch.Tensor:
    """The indices of the `num` highest scores [..., V], highest first [..., num]. Not topk: on the
    GPU its radix select is a dozen kernels a call; this is one for num=1, three more a token
    after."""
    top = scores.argmax(-1, keepdim=True)
    for _ in range(num - 1):
        scores = scores.scatter(-1, top[..., -1:], float("-inf"))
        top = torch.cat([top, scores.argmax(-1, keepdim=True)], -1)
    return top
