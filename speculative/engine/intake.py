"""Where a request comes in: the checks that reject what this server cannot serve (RequestError,
nothing changed; the server's threads run them before the engine's loop sees the request), and a
new Request as the scheduler queues it: its seed and K, its grammar (after its reasoning, if it
starts in reasoning), a resumed request's text."""

import itertools

from speculative.config import MAX_STOP_IDS, SamplingParams
from speculative.engine.chunked_prefill import PrefillPlanner
from speculative.engine.detokenizer import decode
from speculative.engine.request import Request, RequestError
from speculative.engine.request_blocks import RequestBlocks
from speculative.grammar import GrammarError, Grammars, RequestGrammar
from speculative.reasoning_grammar import MarkerTokens, ReasoningGrammar


class RequestIntake:
    def __init__(
        self,
        max_model_len: int,
        k: int,
        eos_token_ids: set[int],
        tokenizer,
        seed: int,
        vocab_size: int | None,
        kv: RequestBlocks | None,
        prefill: PrefillPlanner,
    ):
        self.max_model_len, self.k = max_model_len, k
        self.auto_k = False  # requests that leave num_draft_tokens unset get "auto"
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.seeds = itertools.count(seed * 1_000_003 + 1)
        # prompt ids are checked against it (a bad id would fail the whole step)
        self.vocab_size = vocab_size
        self.kv = kv  # the paged pool's blocks (a request must fit it), or None
        self.prefill = prefill  # the token budget (without a paged pool a prompt must fit it)
        self.grammars: Grammars | None = None  # compiles structured outputs' constraints
        self.markers: dict[str, MarkerTokens] = {}  # reasoning's end markers (reasoning_end)

    def validate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, policy: str
    ) -> None:
        """Raise RequestError if the request cannot be served (under the scheduling `policy`);
        changes nothing."""
        if params.priority and policy == "fcfs":  # as vLLM's documentation says
            raise RequestError(
                f"priority {params.priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this server's is fcfs"
            )
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the maximum sequence length of {self.max_model_len} tokens"
            )
        self._check_token_ids(prompt_ids, params)
        if (
            params.min_tokens
            and len(self.eos_token_ids | set(params.stop_token_ids)) > MAX_STOP_IDS
        ):
            raise RequestError(f"min_tokens holds back at most {MAX_STOP_IDS} EOS and stop tokens")
        k = params.num_draft_tokens
        if k != "auto" and (k or 0) > self.k:
            raise RequestError(
                f"speculative.num_draft_tokens ({params.num_draft_tokens}) exceeds this server's "
                f"{self.k} draft tokens per step"
            )
        if params.prior_output_tokens > len(prompt_ids):
            raise RequestError("prior_output_tokens exceeds the prompt")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer and this model directory has none")
        if self.kv is not None and not self.kv.fits_ever(len(prompt_ids) + params.max_tokens):
            pool = self.kv.manager
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) can never "
                f"fit the KV cache pool of {pool.num_blocks} blocks x {pool.block_size} tokens"
            )
        self.prefill.check_budget(prompt_ids)
        if params.structured is not None:
            self._grammar_for(params)
            if params.reasoning_end is not None:
                self._marker_for(params.reasoning_end)  # built here, off the engine's loop

    def _check_token_ids(self, prompt_ids: list[int], params: SamplingParams) -> None:
        for what, ids in (
            (
                ("prompt", prompt_ids),
                ("logit_bias", params.logit_bias),
                ("stop_token_ids", params.stop_token_ids),
            )
            if self.vocab_size
            else ()
        ):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"{what} token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
                )

    def new_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Request:
        """A validated request, ready to wait for a slot."""
        seed = params.seed if params.seed is not None else next(self.seeds)
        request = Request(
            request_id, list(prompt_ids), params, seed, stops_after=None if params.min_tokens else 0
        )
        k = params.num_draft_tokens
        if k is None:
            k = "auto" if self.auto_k else self.k
        request.is_auto_k = k == "auto" and self.k > 0
        request.num_draft_tokens = self.k if k == "auto" else k
        if params.structured is not None:
            request.grammar = self._grammar_for(params)
            if params.reasoning_end is not None:
                marker = self._marker_for(params.reasoning_end)
                request.grammar = ReasoningGrammar(request.grammar, self.tokenizer, marker)
            prior = prompt_ids[len(prompt_ids) - params.prior_output_tokens :]
            if params.prior_output_tokens and not request.grammar.accept(prior):
                raise RequestError("the resumed request's earlier output does not fit its grammar")
        if params.prior_output_tokens and self.tokenizer is not None:
            # a resumed request's text goes on from its earlier output's: a stop string may span
            # the two, and what the failed engine held back (a possible stop string's start) is
            # sent from here
            request.text = decode(self.tokenizer, request)
            request.num_sent = min(params.prior_text_sent, len(request.text))
            request.read_offset = params.prior_output_tokens
            if request.stops_after == 0:  # the failed engine checked that text, with its min_tokens
                request.stops_after = len(request.text)
        return request

    def _marker_for(self, end: str) -> MarkerTokens:
        """The tokens that would end the reasoning at `end` and begin the content at once (built
        once per marker, from the vocabulary: 0.2 s for SmolLM2's)."""
        if end not in self.markers:
            self.markers[end] = MarkerTokens(self.tokenizer, end, self.vocab_size)
        return self.markers[end]

    def _grammar_for(self, params: SamplingParams) -> RequestGrammar:
        """A new matcher of the request's grammar (compiled once, cached); RequestError naming
        what does not compile."""
        if self.grammars is None:
            if self.tokenizer is None or not self.vocab_size:
                raise RequestError("structured outputs need the model's tokenizer")
            self.grammars = Grammars.for_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        try:
            return self.grammars.matcher(params.structured)
        except GrammarError as e:
            raise RequestError(str(e)) from None
