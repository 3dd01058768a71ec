"""The engine flags `eagleserve generate` and `serve` share: one per EngineConfig field named in
ENGINE_FLAGS (plus --no-overlap), with EngineConfig's defaults."""

import argparse

SCHEDULING_POLICY_HELP = (
    "fcfs: requests in arrival order, a non-zero priority refused; priority: by the requests' "
    "priority (lower first), then arrival, and the lowest priority preempted first (as vLLM's)"
)
ENGINE_FLAGS = (
    "model",
    "drafter",
    "num_draft_tokens",
    "max_batch_size",
    "max_model_len",
    "max_num_batched_tokens",
    "device",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tp",
    "prompt_lookup",
    "draft_siblings",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "scheduling_policy",
)


def engine_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """Engine flags with EngineConfig's defaults. For serve they default to None, so that a flag
    left unset keeps the --config file's value."""
    add = _field_flag_adder(p, serve)
    _model_flags(add)
    _memory_flags(add)
    p.add_argument(
        "--no-overlap", action="store_true", help="process each step's results before the next"
    )
    _speculation_flags(add)


def _field_flag_adder(p: argparse.ArgumentParser, serve: bool):
    """add(*names, shown=None, **kw): a flag for the EngineConfig field its first name spells,
    whose help tells the default (shown: how it names a default of None)."""
    from speculative.config import EngineConfig

    def add(*names, shown=None, **kw):
        field = names[0].lstrip("-").replace("-", "_")
        default = EngineConfig.model_fields[field].default
        if serve:
            kw["help"] += f" (default: {shown or default}, or the --config file's)"
        elif shown:
            kw["help"] += f" (default: {shown})"
        p.add_argument(*names, default=None if serve else default, **kw)

    return add


def _draft_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _model_flags(add) -> None:
    """The model, its drafter and where and how big the engine runs it."""
    add("--model", help="model name, HF directory or .gguf file")
    add(
        "--drafter",
        help="'default', 'none', 'ngram' (drafts looked up in the request: any model, no "
        "drafter) or an EAGLE-3 drafter directory",
    )
    add(
        "--num-draft-tokens",
        "-k",
        type=_draft_tokens,
        help="draft tokens per step (K), or auto: each step's picked from the measured acceptance "
        "and step costs",
    )
    add(
        "--max-batch-size",
        "--max-num-seqs",  # vLLM's name
        type=int,
        help="requests decoded together at most (request slots)",
        shown="256 on CUDA, 8 on CPU; fewer where a step's max-num-batched-tokens holds fewer "
        "verify rows (1 + K tokens each) or the KV cache fewer requests",
    )
    add(
        "--max-model-len",
        type=int,
        help="prompt + output tokens per request at most",
        shown="the model's max_position_embeddings",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        help="tokens one step computes at most: the running requests' verify tokens, then "
        "prefill chunks",
    )
    add("--device", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights' dtype")
    add(
        "--quantization",
        choices=["fp8"],
        help="fp8: the target's linear layers in FP8, quantized at load (FP8 checkpoints "
        "load as FP8 without it)",
        shown="none",
    )
    add(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        help="auto: the weights' dtype; fp8: E4M3 with a scale per layer (twice the tokens)",
    )
    add("--tp", type=int, help="tensor-parallel size (runs on Ray when > 1)")
    add("--scheduling-policy", choices=["fcfs", "priority"], help=SCHEDULING_POLICY_HELP)


def _memory_flags(add) -> None:
    """The KV cache's size and reuse."""
    add(
        "--kv-cache-memory-gb",
        type=float,
        help="GiB of KV cache blocks per rank",
        shown="on CUDA what --gpu-memory-utilization leaves; on CPU every request slot at "
        "max-model-len, at most 1 GiB",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        help="fraction of the GPU's memory the engine may use (weights, activations, CUDA graphs "
        "and the KV cache), when --kv-cache-memory-gb is not set",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV cache blocks of earlier requests' identical prefixes",
    )


def _speculation_flags(add) -> None:
    """What the drafter's chain drafts besides its own tokens."""
    add(
        "--prompt-lookup",
        type=float,
        metavar="P",
        help="draft the token that followed the last five tokens earlier in the request where "
        "the drafter's own draft has probability below P (0: off)",
    )
    add(
        "--draft-siblings",
        type=int,
        metavar="M",
        help="verify the drafter's next M choices at every draft depth too, in the same pass "
        "(0: a chain)",
    )
    for end in ("max", "min"):
        add(
            f"--prompt-lookup-{end}",
            type=int,
            metavar="N",
            help=f"--drafter ngram: the {'longest' if end == 'max' else 'shortest'} run of the "
            "request's last tokens looked up earlier in it",
        )
