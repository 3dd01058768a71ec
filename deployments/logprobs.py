"""OpenAI's logprobs bodies from the engine's entries: (token id, (log-probability, top [(id,
log-probability)])), None instead of the pair for an echoed prompt's first token. A token's bytes
are its own, not those of its text decoded alone: a byte-level BPE token may hold part of a UTF-8
character."""

import codecs


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: every byte is written as one printable character."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TextOffsets:
    """Where each token's text starts in a choice's text (in characters), from the bytes so far: a
    character split over tokens starts at the token that completes it. Special tokens, which the
    completion's text leaves out, take no room; the first `verbatim` tokens (an echoed prompt, in
    the text as it was given) do."""

    def __init__(self, verbatim: int = 0):
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.length, self.verbatim = 0, verbatim

    def add(self, data: bytes, special: bool) -> int:
        start = self.length
        if not special or self.verbatim > 0:
            self.length += len(self.decoder.decode(data))
        self.verbatim -= 1
        return start


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_of = _byte_decoder()
        # what decoding with skip_special_tokens leaves out (all_special_ids may hold only some)
        self.special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }

    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.special or any(
            c not in self.byte_of for c in piece
        ):  # not a byte-level piece
            return self.tokenizer.decode([token_id]).encode()
        return bytes(self.byte_of[c] for c in piece)

    def token_text(self, token_id: int) -> str:
        data = self.token_bytes(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:  # part of a character: vLLM's form
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def chat(self, logprobs: list | None) -> dict | None:
        if logprobs is None:
            return None

        def entry(token_id, logprob):
            return {
                "token": self.token_text(token_id),
                "logprob": logprob,
                "bytes": list(self.token_bytes(token_id)),
            }

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
                for t, (lp, top) in logprobs
            ],
            "refusal": None,
        }

    def completion(self, logprobs: list | None, offsets: TextOffsets) -> dict | None:
        if logprobs is None:
            return None
        return {
            "tokens": [self.token_text(t) for t, _ in logprobs],
            "token_logprobs": [entry and entry[0] for _, entry in logprobs],
            "text_offset": [
                offsets.add(self.token_bytes(t), t in self.special) for t, _ in logprobs
            ],
            "top_logprobs": [
                entry and {self.token_text(i): v for i, v in entry[1]} for _, entry in logprobs
            ],
        }
