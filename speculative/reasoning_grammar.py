"""A grammar that waits for the end of the reasoning a reply starts in, as vLLM's structured outputs
do with a reasoning parser: the reasoning is free until the output's text holds the end marker
(`</think>`), and the grammar (speculative/grammar.py) constrains the tokens after the one that
completed it.

The marker is looked for in the text of the last few tokens, so any tokenization of it counts. One
kind of token is held back while reasoning: one that would complete the marker and go on with
text of the content (SmolLM2's `>"` after `</think`), which the grammar would never see; newlines
may follow, as the reply's reader drops them (deployments/chat_output.py).

Under speculation each verify position's mask follows the same rule along the drafts before it:
the rows up to the draft that completes the marker are the reasoning's, the rows after it the
grammar's from its start. Plain and speculative decoding see the same mask at every position."""

import torch

from speculative.draft_tree import sibling_node
from speculative.grammar import RequestGrammar, bitmask_width


def _packed(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """bool [V] -> the int32 bitmask row [W] (bit t of word t // 32: token t allowed)."""
    bits = torch.zeros(width * 32, dtype=torch.int64)
    bits[: len(allowed)] = allowed.long()
    words = (bits.view(width, 32) << torch.arange(32)).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


class MarkerTokens:
    """One tokenizer's tokens that would end the reasoning and begin the content at once, for each
    number k of the marker's characters the text already ends with: row k of `allowed` holds back
    those whose text starts with the marker's rest and goes on with more than newlines (row 0:
    those that hold all of the marker and more)."""

    def __init__(self, tokenizer, marker: str, vocab_size: int):
        self.marker = marker
        # only a token with the marker's last character can complete it (it shows in the token's
        # own spelling too, byte-level or SentencePiece): decoding the rest would take seconds
        spelled = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        ids = [t for t, s in enumerate(spelled) if s is not None and marker[-1] in s]
        held = [[] for _ in marker]  # per k: the token ids held back
        for t, text in zip(ids, tokenizer.batch_decode([[t] for t in ids])):
            for k in range(len(marker)):
                if self._straddles(text, k):
                    held[k].append(t)
        width = bitmask_width(vocab_size)
        rows = []
        for ids in held:
            allowed = torch.ones(vocab_size, dtype=torch.bool)
            allowed[ids] = False
            rows.append(_packed(allowed, width))
        self.allowed = torch.stack(rows)  # [len(marker), W]

    def _straddles(self, text: str, k: int) -> bool:
        rest = self.marker[k:]
        after = text.partition(self.marker)[2] if self.marker in text else None
        if k and text.startswith(rest):
            after = text[len(rest) :]
        return after is not None and after.strip("\n") != ""

    def allowed_after(self, text: str) -> torch.Tensor:
        """The reasoning's mask row [W] after `text` (the latest reasoning text)."""
        row = self.allowed[0].clone()
        for k in range(1, len(self.marker)):
            if text.endswith(self.marker[:k]):
                row &= self.allowed[k]
        return row


class ReasoningGrammar:
    """RequestGrammar's interface (accept, fill) for a reply that starts in reasoning."""

    def __init__(self, grammar: RequestGrammar, tokenizer, marker: MarkerTokens):
        self.grammar, self.tokenizer, self.marker = grammar, tokenizer, marker
        self.width = grammar.width  # words of a mask row, as RequestGrammar's
        # every token has a character at least: this many hold the text the checks need
        self.window = len(marker.marker) + 1
        self.tail: list[int] = []  # the reasoning's last tokens
        self.is_reasoning = True

    def _text(self, tokens: list[int]) -> str:
        """The text of the last tokens (a marker in it ends with the newest: the ones before it
        have been checked)."""
        return self.tokenizer.decode(tokens[-self.window :])

    def accept(self, tokens: list[int]) -> bool:
        """Advance along emitted tokens: the reasoning's, then the grammar's after the marker."""
        for i, token in enumerate(tokens):
            if not self.is_reasoning:
                return self.grammar.accept(tokens[i:])
            self.tail = (self.tail + [token])[-self.window :]
            self.is_reasoning = self.marker.marker not in self._text(self.tail)
        return True

    def _fill_node(self, rows: torch.Tensor, node: int, path: list[int]) -> bool:
        """The row of the node reached by `path`: the grammar's first if the path's last token
        ended the reasoning (-> True), else the reasoning's."""
        text = self._text(path)
        if self.marker.marker in text:
            self.grammar.fill_row(rows, node)
            return True
        rows[node] &= self.marker.allowed_after(text)
        return False

    def fill(self, rows: torch.Tensor, drafts: list[int], siblings: list[list[int]]) -> None:
        """rows [T, W] <- every verify node's mask (RequestGrammar.fill's layout): the reasoning's
        while the drafts before a node are reasoning, the grammar's after the one that ends it."""
        if not self.is_reasoning:
            self.grammar.fill(rows, drafts, siblings)
            return
        rows.fill_(-1)
        rows[0] &= self.marker.allowed_after(self._text(self.tail))
        K = len(drafts)
        for d in range(K):
            path = self.tail + drafts[:d]
            for j, sibling in enumerate(siblings):
                self._fill_node(rows, sibling_node(K, j, d), path + [sibling[d]])
            if self._fill_node(rows, d + 1, path + [drafts[d]]):
                self.grammar.fill_from(rows, drafts, siblings, d + 1)
                return
