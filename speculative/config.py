"""User-facing configuration (pydantic, extra fields forbidden). Never mutated at runtime."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

GREEDY_BELOW = 1e-5  # temperatures under it decode greedily, as in vLLM
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
MAX_STOP_STRINGS = 1024  # each is searched for after every token, on the engine's thread
MAX_STOP_IDS = 80  # EOS ids + stop_token_ids that min_tokens holds back, per request
LogitBiasValue = Annotated[
    float, Strict(), Field(ge=-100.0, le=100.0)
]  # Strict: JSON true is no bias


class StructuredSpec(BaseModel):
    """A constraint on the output (speculative/grammar.py compiles it): a JSON schema (its JSON
    text), any JSON object, a regular expression, one of `choices`, or an EBNF grammar (xgrammar's
    GBNF dialect)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    spec: str = ""  # json: the schema as JSON text; regex: the pattern; grammar: the EBNF
    choices: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self):
        if self.kind in ("json", "regex", "grammar") and not self.spec:
            raise ValueError(f"structured output {self.kind!r} needs a non-empty spec")
        if self.kind == "choice" and not (self.choices and all(self.choices)):
            raise ValueError("structured output 'choice' needs non-empty choices")
        return self


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=2.0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # 0 or -1: off; any k over the vocabulary is no cut
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # 0: off
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(
        default_factory=list, max_length=64
    )  # end like EOS (vLLM's extension)
    ignore_eos: bool = False
    # vLLM's: no EOS, stop token or stop string ends the output before this many
    min_tokens: int = Field(0, ge=0)
    # OpenAI's, over the output so far:
    # logits -= frequency_penalty * count + presence_penalty * (count > 0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's (and Hugging Face's): the logits of tokens in the prompt or the output so far are
    # divided by it where positive, multiplied where negative; before the two above. 1: off
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    # OpenAI's: added to the logits of these token ids
    logit_bias: dict[int, LogitBiasValue] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    # the prompt ends with this request's earlier output (resumed)
    prior_output_tokens: int = Field(0, ge=0)
    prior_text_sent: int = Field(0, ge=0)  # characters of that output's text the client has
    # None: off; else the chosen token's + this many top ones
    logprobs: int | None = Field(None, ge=0, le=20)
    # the same for the prompt's tokens (after the first)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    # per request: drafts verified per step, at most the engine's K; 0: no speculation; "auto":
    # the engine picks each step's (speculative/draft_length.py). None: the engine's
    num_draft_tokens: Annotated[int, Field(ge=0, le=16)] | Literal["auto"] | None = None
    # structured outputs: every token is one the grammar allows there (speculative/grammar.py)
    structured: StructuredSpec | None = None
    # vLLM's: under the priority scheduling policy, lower values are admitted first and
    # preempted last; the scheduler reads it, the workers never do. 0 under fcfs
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    # with `structured`: the output is reasoning, free, until its text holds this marker; the
    # grammar constrains the tokens after it (speculative/reasoning_grammar.py). None: all of them
    reasoning_end: str | None = Field(None, min_length=1)

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, t: float) -> float:
        # below 1e-5 sampling is the argmax anyway, and logits / T overflow float32 (NaN
        # probabilities)
        return 0.0 if t < GREEDY_BELOW else t

    @model_validator(mode="after")
    def _check_stop(self):
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # the grammar ends the output with EOS, which these would forbid or go past
            raise ValueError("structured outputs cannot be combined with ignore_eos or min_tokens")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty) or self.repetition_penalty != 1


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    # "default", "none", "ngram" (drafts looked up in the request, no drafter model:
    # speculative/ngram.py) or a directory
    drafter: str = "default"
    # K; ignored when drafter is "none". 5: with the default drafter, K=5 was faster than K=3 on the
    # H200 at batch 1, 8 and 32 (BENCHMARKS.md, run E); on CPU the two were within noise
    # "auto": each step's K picked from the measured acceptance and step costs, at most
    # auto_max_draft_tokens (speculative/draft_length.py)
    num_draft_tokens: Annotated[int, Field(ge=1, le=16)] | Literal["auto"] = 5
    auto_max_draft_tokens: int = Field(5, ge=1, le=16)
    # request slots (vLLM's max_num_seqs); None: derived (workers/kv_sizing.py's default_slots)
    max_batch_size: int | None = Field(None, ge=1, le=1024)
    # prompt + output tokens per request; None: the model's max_position_embeddings (a larger
    # value is capped to them)
    max_model_len: int | None = Field(None, ge=16)
    max_num_batched_tokens: int = Field(4096, ge=16)  # prefill tokens per step
    memory_budget_gb: float | None = Field(None, gt=0)  # caps max_batch_size by KV cache size
    # the paged KV pool (workers/kv_sizing.py): its size in GiB per rank, which always wins; else
    # on CUDA what gpu_memory_utilization x the GPU leaves after the weights, a profiled peak
    # step and the CUDA graphs, on CPU every slot at full length up to 1 GiB. Then tokens per
    # block, and whether full blocks of earlier requests are reused
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_block_size: int = Field(16, ge=16, le=1024, multiple_of=16)
    enable_prefix_caching: bool = True
    # as vLLM's --scheduling-policy: fcfs admits in arrival order and preempts the latest
    # admitted; priority admits by (priority, arrival) and preempts the largest (priority, arrival)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # fp8: the target's linear layers in FP8 E4M3, a bf16/fp16 checkpoint's quantized at load
    # with a scale per output row (an FP8 checkpoint is FP8 without it); embeddings, the LM head
    # and the drafter stay in dtype. KV cache fp8: E4M3 rows with a scale per layer, twice the
    # tokens in the same memory
    quantization: Literal["fp8"] | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tp: int = Field(1, ge=1)
    overlap: bool = True
    cuda_graphs: bool = True
    graph_first_draft: bool = False  # one graph per greedy decode step: verify + all drafts
    # prompt lookup in the draft chain (speculative/prompt_lookup.py): where the drafter's own draft
    # has probability below this, draft the token that followed the last five tokens earlier in
    # the request instead. 0: off
    prompt_lookup: float = Field(0.0, ge=0.0, le=1.0)
    # the draft tree (speculative/draft_tree.py): at every depth of the chain, the drafter's next
    # this many choices are verified too, in the same target pass. 0: a chain
    draft_siblings: int = Field(0, ge=0, le=4)
    # drafter "ngram": the longest and shortest run of the request's last tokens it looks up
    # (vLLM's names)
    prompt_lookup_max: int = Field(4, ge=1, le=16)
    prompt_lookup_min: int = Field(2, ge=1, le=16)
    seed: int = Field(
        0, ge=0, le=2**40
    )  # seeds requests that bring none (seed * 1000003 + n fits int64)

    @model_validator(mode="after")
    def _check_ngram(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        if self.drafter == "ngram" and (self.prompt_lookup or self.draft_siblings):
            # both are the drafter's: its probabilities choose between its drafts and a lookup,
            # its next choices are the siblings
            raise ValueError(
                "prompt_lookup and draft_siblings need an EAGLE-3 drafter, not drafter ngram"
            )
        return self

    @property
    def speculative(self) -> bool:
        return self.drafter != "none"

    @property
    def is_auto_k(self) -> bool:
        return self.num_draft_tokens == "auto" and self.speculative

    @property
    def k(self) -> int:
        """The most drafts a step makes per row: the shapes' K."""
        if not self.speculative:
            return 0
        return self.auto_max_draft_tokens if self.is_auto_k else self.num_draft_tokens
