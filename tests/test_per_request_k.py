"""Per-request speculation (SamplingParams.num_draft_tokens): a row that verifies k of the step's K
drafts gives exactly what verification with K = k gives; a batch mixes requests with different k;
a row drafts only its own k (no drafter forward past it); acceptance statistics count only the
drafts that were verified."""

import contextlib

import pytest
import torch
from conftest import run_to_completion

from speculative.config import SamplingParams
from speculative.engine.scheduler import RequestError
from speculative.sampling import target_probs
from speculative.verify import verify_greedy, verify_sampled


def _random_case(seed: int, B: int = 256, K: int = 4, V: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    drafts = torch.where(
        torch.rand(B, K, generator=g) < 0.7,
        logits[:, :K].argmax(-1),
        torch.randint(0, V, (B, K), generator=g),
    )
    u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    return logits, drafts, u_accept, u_sample, torch.randint(0, K + 1, (B,), generator=g)


@pytest.mark.parametrize("seed", [0, 1])
def test_capped_rows_verify_as_their_own_k(seed):
    """Row by row, K drafts capped at k == the first k drafts verified with K = k: the same
    tokens and counts, greedy and sampled (the same uniforms at the same positions)."""
    logits, drafts, u_accept, u_sample, limit = _random_case(seed)
    probs = target_probs(logits, torch.ones(len(limit)), None, None)
    greedy = verify_greedy(logits.argmax(-1), drafts, None, limit)
    sampled = verify_sampled(probs, drafts, u_accept, u_sample, draft_limit=limit)
    assert (greedy[1] <= limit + 1).all() and (sampled[1] <= limit + 1).all()
    assert (greedy[1] == limit + 1).any() and (sampled[1] < limit + 1).any()  # both cases occur
    for row, k in enumerate(limit.tolist()):
        r = slice(row, row + 1)
        g_ref = verify_greedy(logits[r, : k + 1].argmax(-1), drafts[r, :k])
        s_ref = verify_sampled(
            probs[r, : k + 1], drafts[r, :k], u_accept[r, :k], u_sample[r, : k + 1]
        )
        for out, ref in ((greedy, g_ref), (sampled, s_ref)):
            n = int(ref[1])
            assert int(out[1][row]) == n
            assert out[0][row, :n].tolist() == ref[0][0, :n].tolist()


@pytest.fixture(scope="module")
def engine_k5():
    from conftest import _smollm2

    return _smollm2("default", num_draft_tokens=5, max_batch_size=6)


def test_mixed_k_batch_is_greedy_exact(
    engine_k5, smollm2_prompts, smollm2_greedy_64, smollm2_near_tie
):
    """One batch of requests with K = 0, 1, 2, 5 and the default: each equals plain decoding; each
    accepts at most its k drafts a step, none at K = 0."""
    ks = [0, 1, 2, 5, None, 0]
    params = [SamplingParams(max_tokens=40, num_draft_tokens=k) for k in ks]
    prompts = smollm2_prompts[: len(ks)]
    before = engine_k5.scheduler.stats.num_draft_proposed
    requests = run_to_completion(engine_k5, prompts, params)
    for prompt, r, ref in zip(prompts, requests, smollm2_greedy_64):
        smollm2_near_tie(prompt, r.output_ids, ref[:40])
    for r, k in zip(requests, ks):
        k = 5 if k is None else k
        assert r.acceptance_length <= k + 1
        assert (r.num_verify_steps == 0) == (k == 0)
    assert max(r.acceptance_length for r in requests) > 2  # K=5 rows really speculate
    proposed = engine_k5.scheduler.stats.num_draft_proposed - before
    k_of = {id(r): 5 if k is None else k for r, k in zip(requests, ks)}
    assert proposed == sum(k_of[id(r)] * r.num_verify_steps for r in requests)


def test_k0_sampling_equals_plain_decoding(engine_k5, smollm2_engine, smollm2_prompts):
    """Seeded sampling with speculation off for the request: token for token plain decoding's
    (the same uniforms at the same positions), in a batch beside speculating requests."""
    prompts = smollm2_prompts[:4]
    sampled = dict(temperature=0.8, top_p=0.95, max_tokens=32)
    plain = smollm2_engine.generate(prompts[:2], SamplingParams(seed=7, **sampled))
    mixed = [SamplingParams(seed=7, num_draft_tokens=0, **sampled)] * 2
    # greedy, K=5 and auto, beside them
    mixed += [SamplingParams(max_tokens=32), SamplingParams(max_tokens=32, num_draft_tokens="auto")]
    requests = run_to_completion(engine_k5, prompts, mixed)
    assert [r.output_ids for r in requests[:2]] == [r.output_ids for r in plain]


def test_k_over_the_engines_is_refused(engine_k5, smollm2_prompts):
    with pytest.raises(RequestError, match="num_draft_tokens"):
        engine_k5.add_request(smollm2_prompts[0], SamplingParams(num_draft_tokens=6))


class CountingDrafter:
    """The real drafter, recording the slots of each of its forwards."""

    def __init__(self, drafter):
        self.drafter, self.forwards = drafter, []

    def __call__(self, ids, hidden, batch, **kwargs):
        self.forwards.append(batch.slots.tolist())
        return self.drafter(ids, hidden, batch, **kwargs)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


@contextlib.contextmanager
def counting_drafter(engine):
    proposer = engine.executor.proposer
    proposer.drafter = CountingDrafter(proposer.drafter)
    try:
        yield proposer.drafter
    finally:
        proposer.drafter = proposer.drafter.drafter


def test_rows_draft_only_their_own_k(
    engine_k5, smollm2_prompts, smollm2_greedy_64, smollm2_near_tie
):
    """K = 0, 1, 5 and auto in one batch, greedy: each equals plain decoding, and each row is in
    exactly K drafter forwards per step (the prefill's first, over the prompt, for every row):
    a K=1 row in one, a K=0 row in none after its prompt's."""
    ks = [0, 1, 5, "auto"]
    params = [SamplingParams(max_tokens=40, num_draft_tokens=k) for k in ks]
    prompts = smollm2_prompts[6 : 6 + len(ks)]
    slot_of = {}

    def record_slot(i, output):
        if i not in slot_of:  # its first output: it runs (its last, released, may not)
            slot_of[i] = engine_k5.scheduler.running[output.request_id].slot

    engine_k5.overlap = False  # no extra pass: a row's steps are its verify steps
    try:
        with counting_drafter(engine_k5) as counting:
            requests = run_to_completion(engine_k5, prompts, params, on_output=record_slot)
    finally:
        engine_k5.overlap = True
    for prompt, r, ref in zip(prompts, requests, smollm2_greedy_64[6:]):
        smollm2_near_tie(prompt, r.output_ids, ref[:40])
    in_forwards = [sum(slot_of[i] in f for f in counting.forwards) for i in range(len(ks))]
    assert in_forwards[0] == 1  # the prompt's only
    for i in (1, 2):  # the prefill step's K and each verify step's K
        assert in_forwards[i] == ks[i] * (1 + requests[i].num_verify_steps)
    assert requests[2].acceptance_length > 1.3  # K=5 really speculates beside them
    assert 1 <= in_forwards[3] <= 5 * (1 + requests[3].num_verify_steps)
