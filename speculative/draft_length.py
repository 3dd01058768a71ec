"""`num_draft_tokens: auto`: the K that maximises a step's expected tokens per second, from
measured numbers only. Pure functions; the engine's tuner (speculative/engine/draft_tuner.py)
measures the acceptance and the step costs and calls them every step.

A row whose drafts are accepted at position j with conditional probability a_j (given the drafts
before it were) emits, drafting k, 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens in expectation.
The step drafting k costs c_k seconds (its verify pass and k draft forwards at the batch's size),
so it yields sum over rows / c_k tokens per second; k = 0 is plain decoding."""


def expected_tokens(rates: list[float], k: int) -> float:
    """Expected tokens a row emits drafting k, given its conditional acceptance `rates` [>= k]."""
    total, reach = 1.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


# a longer draft must promise this much more throughput than the best shorter one: measured costs
# are noisy, and a draft that gains nothing still costs forwards
MIN_GAIN = 0.02


def choose_draft_length(
    row_rates: list[list[float]], step_seconds: list[float], fixed_tokens: float = 0.0
) -> int:
    """The k in 0..len(step_seconds)-1 with the most expected tokens per second for a step whose
    auto rows accept as `row_rates` (one list of K rates per row) and whose other rows emit
    `fixed_tokens` whatever k; step_seconds[k]: the step's cost drafting k. Near-ties (within
    MIN_GAIN) go to the smaller k."""
    best, best_rate = 0, -1.0
    for k, seconds in enumerate(step_seconds):
        tokens = fixed_tokens + sum(expected_tokens(rates, k) for rates in row_rates)
        rate = tokens / seconds
        if rate > best_rate * (1 + MIN_GAIN):
            best, best_rate = k, rate
    return best


def bucket(batch: int) -> int:
    """The batch sizes whose step costs are kept apart: powers of two."""
    return 1 << (batch - 1).bit_length()
