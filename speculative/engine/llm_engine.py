"""The decode loop in one process: scheduler + an executor (a local ModelRunner, or the Ray
workers behind the same `execute(plan) -> handle` interface), keeping one step in flight."""

import itertools
import logging
from collections import deque

from speculative.config import EngineConfig, SamplingParams
from speculative.engine.block_manager import BlockManager
from speculative.engine.request import Request, RequestOutput
from speculative.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def encode_prompt(tokenizer, prompt: str | list[dict], raw: bool = False) -> list[int]:
    """Text (or chat messages) -> token ids; the chat template is applied unless `raw`."""
    if raw:
        return tokenizer.encode(prompt, add_special_tokens=False)
    return encode_chats(
        tokenizer, [[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt]
    )[0]


def encode_chats(tokenizer, chats: list[list[dict]]) -> list[list[int]]:
    """The chat template applied to many conversations at once: a fast tokenizer encodes the batch
    in parallel (self-distillation encodes ~80k prompts)."""
    ids = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=True)
    return [list(x) for x in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def eos_ids(tokenizer, model_dir) -> set[int]:
    """The tokenizer's EOS and those of config.json and generation_config.json."""
    from workers.models.config import eos_token_ids

    ids = (
        {tokenizer.eos_token_id}
        if tokenizer is not None and tokenizer.eos_token_id is not None
        else set()
    )
    return ids | eos_token_ids(model_dir)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, executor=None):
        from workers.models import load_config
        from workers.models.loader import load_tokenizer, resolve_model

        self.cfg = cfg
        model_dir = resolve_model(cfg.model)
        self.tokenizer = load_tokenizer(model_dir)
        if executor is None:
            from workers.model_runner import ModelRunner

            executor = ModelRunner(cfg)
        self.executor = executor
        model_config = load_config(model_dir)
        self.scheduler = Scheduler(
            executor.num_slots,
            executor.max_model_len,
            cfg.max_num_batched_tokens,
            cfg.k,
            eos_ids(self.tokenizer, model_dir),
            self.tokenizer,
            cfg.seed,
            vocab_size=model_config.get("vocab_size"),
            tree_rows=cfg.k * cfg.draft_siblings,
            blocks=BlockManager(
                executor.num_blocks, executor.block_size, cfg.enable_prefix_caching
            ),
            policy=cfg.scheduling_policy,
            auto_k=cfg.is_auto_k,
            step_costs=getattr(executor, "step_costs", None),
        )
        # prompt lookup and n-gram drafts read a request's whole prompt from the workers' history
        self.scheduler.prefill.sends_cached_ids = cfg.prompt_lookup > 0 or cfg.drafter == "ngram"
        self.in_flight = deque()  # (plan, handle), oldest first
        self.overlap = cfg.overlap  # may be switched between runs (benchmarks)
        self.device_s = 0.0  # GPU time of processed steps (0 on CPU)
        self.request_ids = itertools.count()

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Request:
        if not request_id:  # an id of our own that no caller's request holds
            request_id = next(
                i for i in (f"req-{n}" for n in self.request_ids) if not self.scheduler.in_use(i)
            )
        return self.scheduler.add(request_id, prompt_ids, params)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the oldest step's results: with overlap, only once
        another step is in flight behind it, so the host work runs while the device computes."""
        plan = self.scheduler.plan()
        if plan is not None:
            self.in_flight.append((plan, self.executor.execute(plan)))
        elif not self.in_flight and self.scheduler.has_work:  # nothing would ever change
            raise RuntimeError("requests are running, but no step holds them and none is planned")
        depth = 1 if self.overlap else 0
        if len(self.in_flight) > depth or (plan is None and self.in_flight):
            done_plan, handle = self.in_flight.popleft()
            result = handle.result()
            self.device_s += result.device_s
            outputs = self.scheduler.process(done_plan, result)
            # the next step's constrained rows that were in this one: their masks, now known
            late = self.scheduler.late_grammar(self.in_flight[0][0]) if self.in_flight else None
            if late is not None:
                self.executor.send_late_grammar(late)
            return outputs
        return []

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Run prompts (token ids) to completion; returns the finished requests in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        while self.has_work:
            self.step()
        return requests
