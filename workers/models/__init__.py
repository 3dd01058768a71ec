"""Target model families, keyed by the Hugging Face architecture name in config.json.

A new family is a file here (its layer on the shared decoder) plus a line in MODELS, and its
name in `config.SUPPORTED_ARCHITECTURES`."""

from workers.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, load_config
from workers.models.decoder import DecoderModel
from workers.models.gpt_oss import GptOss
from workers.models.llama import Llama
from workers.models.mistral import Mistral
from workers.models.mixtral import Mixtral
from workers.models.qwen2 import Qwen2
from workers.models.qwen2_moe import Qwen2Moe
from workers.models.qwen3 import Qwen3
from workers.models.qwen3_moe import Qwen3Moe

MODELS: dict[str, type[DecoderModel]] = {
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Mistral,
    "Qwen2ForCausalLM": Qwen2,
    "Qwen3ForCausalLM": Qwen3,
    "MixtralForCausalLM": Mixtral,
    "Qwen2MoeForCausalLM": Qwen2Moe,
    "Qwen3MoeForCausalLM": Qwen3Moe,
    "GptOssForCausalLM": GptOss,
}
assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)


def model_class(cfg: ModelConfig) -> type[DecoderModel]:
    return MODELS[cfg.architecture]


__all__ = ["MODELS", "DecoderModel", "ModelConfig", "load_config", "model_class"]
