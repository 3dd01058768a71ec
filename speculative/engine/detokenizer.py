"""A request's output as a step's tokens arrive: where it stops (max_tokens, EOS and stop tokens,
stop strings) and its text, detokenized incrementally (vLLM's rules: a stop string ends the text
before it, a stream never sends the start of one, and with min_tokens it counts only where it ends
past the first min_tokens tokens' text)."""

from speculative.engine.request import Request


def text_ids(r: Request) -> list[int]:
    """The tokens of the request's text: its output (less a stop token), after the earlier
    output of a resumed request."""
    prior = r.params.prior_output_tokens
    output = r.output_ids[:-1] if r.ends_with_stop_token else r.output_ids
    return r.prompt_ids[len(r.prompt_ids) - prior :] + output if prior else output


def decode(tokenizer, r: Request) -> str:
    return tokenizer.decode(text_ids(r), skip_special_tokens=True)


def find_stop(r: Request, text: str) -> int | None:
    """Where the text ends at the earliest stop string that ends after `r.stops_after`
    characters, if any does: where it starts, or where it ends with include_stop_str_in_output
    (None before min_tokens tokens: vLLM's rule, a stop string must end past their text)."""
    if r.stops_after is None:
        return None
    hits = [
        (at, len(stop))
        for stop in r.params.stop
        if (at := text.find(stop, max(0, r.stops_after - len(stop) + 1))) >= 0
    ]
    if not hits:
        return None
    at, length = min(hits)
    return at + length if r.params.include_stop_str_in_output else at


def detokenize(tokenizer, r: Request) -> str:
    """The text the new tokens add, decoding only a few tokens of context before them (a
    whole re-decode each step costs ~27 us per 128 tokens, per request, on the coordinator's
    thread)."""
    tokens = text_ids(r)
    context = tokenizer.decode(tokens[r.prefix_offset : r.read_offset], skip_special_tokens=True)
    window = tokenizer.decode(tokens[r.prefix_offset :], skip_special_tokens=True)
    if window.endswith("\ufffd") and not r.is_finished:  # a multi-byte character, incomplete
        return ""
    if window.startswith(context):
        text = r.text + window[len(context) :]
    else:  # the context decodes differently with what follows it: decode the whole output
        text = decode(tokenizer, r)
    r.prefix_offset, r.read_offset = r.read_offset, len(tokens)
    at = find_stop(r, text) if r.params.stop else None
    if at is not None:
        text = text[:at]
    r.text = text
    # what may be the start of a stop string is held back until later tokens complete or
    # refute it
    end = len(text) if r.is_finished else len(text) - partial_stop(r, text)
    delta = text[r.num_sent : end]
    r.num_sent = max(r.num_sent, end)
    return delta


def partial_stop(r: Request, text: str) -> int:
    """The length of the longest end of `text` that is the beginning of a stop string."""
    return max(
        (k for stop in r.params.stop for k in range(1, len(stop)) if text.endswith(stop[:k])),
        default=0,
    )


def append_tokens(r: Request, tokens: list[int], eos_token_ids: set[int], tokenizer, finish):
    """Append a step's emitted tokens to r's output up to where it stops, which `finish(r,
    reason)` ("stop", "length") ends. -> the tokens appended."""
    new = []
    for token in tokens:
        if len(r.output_ids) >= r.params.max_tokens:
            break
        r.output_ids.append(token)
        new.append(token)
        if token in eos_token_ids and not r.params.ignore_eos or token in r.params.stop_token_ids:
            # a generated token (its id, log-probability, usage) with no text, as in vLLM:
            # harnesses read the continuation's log-probabilities as all but the last token's
            r.ends_with_stop_token = True
            finish(r, "stop")
            break
        if r.params.stop and r.stops_after is None and len(r.output_ids) == r.params.min_tokens:
            r.stops_after = len(decode(tokenizer, r))
        # token by token, so the output ends where plain decoding (one token a step) ends it
        if r.params.stop and find_stop(r, decode(tokenizer, r)) is not None:
            finish(r, "stop")
            break
    if not r.is_finished and len(r.output_ids) >= r.params.max_tokens:
        finish(r, "length")
    return new
