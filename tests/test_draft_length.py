"""The decision of `num_draft_tokens: auto` (speculative/draft_length.py) and its measurements
(speculative/engine/draft_tuner.py) over given numbers."""

import pytest

from speculative.draft_length import bucket, choose_draft_length, expected_tokens
from speculative.engine.draft_tuner import PROBE_EVERY, DecayedAcceptance, DraftTuner
from speculative.engine.request import Request

K = 5


def test_expected_tokens():
    assert expected_tokens([0.5] * K, 0) == 1.0
    assert expected_tokens([0.5] * K, 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0] * K, K) == K + 1


def _linear_costs(per_draft: float) -> list[float]:
    return [1.0 + per_draft * k for k in range(K + 1)]


@pytest.mark.parametrize(
    ("rate", "per_draft", "best"),
    [
        (0.0, 0.1, 0),  # nothing accepted: plain decoding
        (1.0, 0.1, K),  # everything accepted, drafts cheap: the most
        (0.8, 0.1, 5),
        (0.6, 0.3, 1),  # acceptance that cannot pay for longer chains
        (0.9, 2.0, 0),  # drafts dearer than the tokens they bring
    ],
)
def test_choice_maximises_tokens_per_second(rate, per_draft, best):
    seconds = _linear_costs(per_draft)
    assert choose_draft_length([[rate] * K] * 4, seconds) == best
    rates = [expected_tokens([rate] * K, k) / s for k, s in enumerate(seconds)]
    assert rates[best] == max(rates)


def test_fixed_rows_count_whatever_k():
    """Rows of fixed K add the same tokens to every choice, so they favour the cheaper step."""
    seconds = _linear_costs(0.25)
    alone = choose_draft_length([[0.6] * K], seconds)
    beside = choose_draft_length([[0.6] * K], seconds, fixed_tokens=20.0)
    assert alone > 0 and beside == 0


def test_acceptance_is_decayed_per_position():
    acceptance = DecayedAcceptance(K)
    acceptance.add(accepted=2, limit=4, decay=0.5)  # positions 1, 2 accepted, 3 rejected
    assert acceptance.trials == [1, 1, 1, 0, 0] and acceptance.hits == [1, 1, 0, 0, 0]
    acceptance.add(accepted=1, limit=1, decay=0.5)  # only position 1 tried
    assert acceptance.trials == [1.5, 0.5, 0.5, 0, 0] and acceptance.hits[0] == 1.5
    assert acceptance.rates([0.7] * K, 1.0) == pytest.approx([2.2 / 2.5, 0.8, 0.7 / 1.5, 0.7, 0.7])
    first = 2.2 / 2.5
    second = (0.5 + first) / 1.5
    third = second / 1.5  # untried beyond it: as the last one tried
    assert acceptance.chained_rates(0.7, 1.0) == pytest.approx([first, second, third, third, third])


def test_tuner_learns_costs_and_probes():
    tuner = DraftTuner(K, {(bucket(3), k): 1.0 + 0.1 * k for k in range(K + 1)})
    request = Request("r", [1], None, 0, is_auto_k=True, num_draft_tokens=K)
    for _ in range(30):
        tuner.observe(request, accepted=0, limit=1)
    choices = [tuner.choose([request], [], 3) for _ in range(2 * PROBE_EVERY + 2)]
    assert choices.count(0) == 2 * PROBE_EVERY and choices.count(1) == 2  # the probes
    for _ in range(30):
        tuner.observe(request, accepted=K, limit=K)
    assert tuner.choose([request], [], 3) == K
    for _ in range(30):  # drafting turns out dear at this batch size
        tuner.observe_cost(3, K, 50.0)
    assert tuner.choose([request], [], 3) < K


def test_tuner_ignores_steps_without_timing():
    """A result that measured no time (0 s) neither divides by zero nor zeroes the costs."""
    tuner = DraftTuner(K)
    tuner.observe_cost(1, 1, 0.0)
    tuner.observe_cost(1, 1, 0.002)
    tuner.observe_cost(1, 1, 0.0)
    tuner.observe_cost(1, 1, 0.004)
    assert tuner.step_cost(1, 1) > 0.002
