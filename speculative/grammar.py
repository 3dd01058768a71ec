"""Structured outputs on the host: constraints compiled by xgrammar and cached, one matcher per
request that follows its output, and the packed bitmask rows (int32, bit t of word t // 32: token t
allowed) of each step's verify positions, which sampling.py applies to the logits.

xgrammar, not llguidance: on SmolLM2's 49152-token vocabulary its bitmask takes 2 us (median)
against llguidance's 15 us, and the host fills K+1 of them per request per step; compiling a JSON
schema takes 11 ms against 1 ms, once per schema thanks to the cache (docs/STRUCTURED_OUTPUTS.md).

Under speculation the mask of verify position j is the grammar's state after the output and drafts
1..j: the matcher is advanced along the drafts and rolled back. A draft the grammar forbids is cut
by its own position's mask (the target cannot choose it, so verification rejects it, greedy and
sampled alike); the positions after it keep all-allowed rows that no accepted token reads."""

import json
import re
import threading
from collections import OrderedDict

import numpy as np
import torch
import xgrammar as xgr

from speculative.config import StructuredSpec
from speculative.draft_tree import sibling_node

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# xgrammar unrolls a regex's counted repetition inside a JSON schema: "a{2000}" compiles in 0.2 s,
# "a{50000}" ran past two minutes, holding the engine's loop (the compile is not interruptible)
MAX_REPEAT = 1000
_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


class GrammarError(ValueError):
    """A constraint the library cannot compile."""


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def tool_call_schema(tools: list[dict], tool_choice, parallel: bool = True) -> dict:
    """The JSON schema of the calls a forced tool_choice makes: `tools` as OpenAI sends them
    ([{"type": "function", "function": {"name", "parameters"?, ...}}]), tool_choice "required"
    or {"type": "function", "function": {"name": ...}}. -> a schema for a JSON array of one or
    more (one without `parallel`) {"name": <a tool's name>, "arguments": <an object valid for its
    parameters>} (a named choice: that tool only). Raises ValueError naming what is wrong (no
    tools, an unknown name)."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    if tool_choice != "required":
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    if not functions:
        raise ValueError("tool_choice 'required' needs at least one function in tools")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return schema | {"minItems": 1} | ({} if parallel else {"maxItems": 1})


def choice_ebnf(choices: tuple[str, ...]) -> str:
    # JSON string literals are EBNF string literals in xgrammar's dialect
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """The compiler for one tokenizer, with a cache of compiled grammars (thread-safe: the
    server's threads validate requests while the engine's loop admits them)."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.cache: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self.lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids) -> "Grammars":
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        return cls(info)

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """Raises GrammarError naming the problem."""
        with self.lock:
            compiled = self.cache.get(spec)
            if compiled is None:
                compiled = self._compile(spec)
                self.cache[spec] = compiled
                if len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
            self.cache.move_to_end(spec)
            return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        c = self.compiler
        if spec.kind in ("json", "regex"):
            _check_repeats(spec.spec)
        try:
            if spec.kind in ("json", "json_object"):
                # no free whitespace: small models given the choice indent forever (SmolLM2 did)
                schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            text = choice_ebnf(spec.choices) if spec.kind == "choice" else spec.spec
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "grammar": "EBNF grammar"}.get(spec.kind, spec.kind)
            raise GrammarError(f"the {what} does not compile: {_reason(e)}") from None

    def matcher(self, spec: StructuredSpec) -> "RequestGrammar":
        return RequestGrammar(self.compile(spec), self.vocab_size)


def _check_repeats(text: str) -> None:
    for m in _COUNTED.finditer(text):
        bound = max(int(n) for n in m.groups() if n)
        if bound > MAX_REPEAT:
            raise GrammarError(
                f"the repetition {m.group(0)} exceeds the limit of {MAX_REPEAT} (a larger "
                "count takes too long to compile)"
            )


def _reason(e: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)


class RequestGrammar:
    """One request's grammar state: follows the accepted output, fills the next step's rows."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.compiled = compiled  # also sent to the ranks, whose drafts follow it
        self.matcher = xgr.GrammarMatcher(compiled)
        self.width = bitmask_width(vocab_size)

    def accept(self, tokens: list[int]) -> bool:
        """Advance along emitted tokens; False if the grammar refuses one (a bug, or a resumed
        request's earlier output that does not fit)."""
        return all(self.matcher.accept_token(t) for t in tokens)

    def fill(self, rows: torch.Tensor, drafts: list[int], siblings: list[list[int]]) -> None:
        """rows [T, W] int32 (T = 1 + K(M+1): the verify pass's nodes, speculative/draft_tree.py)
        <- the mask of every node: the pending token's from the grammar's state, each chain
        draft's and sibling's after the drafts before it and itself. drafts [K], siblings [M][K]."""
        rows.fill_(-1)
        self.fill_from(rows, drafts, siblings, 0)

    def fill_row(self, rows: torch.Tensor, node: int) -> None:
        """One node's row <- the mask of the grammar's state (no drafts followed)."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(rows, node)

    def fill_from(self, rows, drafts: list[int], siblings: list[list[int]], start: int) -> None:
        """`fill`'s rows from chain position `start` on, the grammar's state being that position's
        (the drafts before it are not the grammar's: speculative/reasoning_grammar.py); the rows
        before it are left as they are."""
        m, K = self.matcher, len(drafts)
        if m.is_terminated():
            return
        m.fill_next_token_bitmask(rows, start)
        depth = 0  # chain drafts the grammar accepted
        for d in range(start, K):
            for j, sibling in enumerate(siblings):
                if m.accept_token(sibling[d]):
                    if not m.is_terminated():
                        m.fill_next_token_bitmask(rows, sibling_node(K, j, d))
                    m.rollback(1)
            if not m.accept_token(drafts[d]):
                break  # cut: this draft's own row (filled above) forbids it
            depth += 1
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(rows, d + 1)
        if depth:
            m.rollback(depth)


class PortableGrammar:
    """A compiled grammar as a step plan carries it to the ranks (workers/draft_grammar.py): the
    object itself within a process; pickled, its JSON and what the rank's own TokenizerInfo must
    match (xgrammar's compiled grammars do not pickle, and the tokenizer's part is 1.6 MB for
    SmolLM2, so each rank builds that once from its own tokenizer)."""

    def __init__(self, compiled: xgr.CompiledGrammar | None, text: str = "", stop_ids=()):
        self.compiled, self.text = compiled, text
        info = compiled.tokenizer_info if compiled is not None else None
        self.stop_ids = tuple(info.stop_token_ids) if info is not None else tuple(stop_ids)

    def __reduce__(self):
        text = self.text or self.compiled.serialize_json()
        return PortableGrammar, (None, text, self.stop_ids)

    def resolve(self, info_for) -> xgr.CompiledGrammar:
        """The compiled grammar; a pickled one deserialized against info_for(stop_ids), the
        rank's TokenizerInfo (raises xgrammar's errors where it does not match)."""
        if self.compiled is None:
            self.compiled = xgr.CompiledGrammar.deserialize_json(self.text, info_for(self.stop_ids))
        return self.compiled


def new_masks(num_rows: int, width: int, vocab_size: int) -> np.ndarray:
    """[rows, T, W] int32 rows for a plan, all tokens allowed."""
    return np.full((num_rows, width, bitmask_width(vocab_size)), -1, dtype=np.int32)
