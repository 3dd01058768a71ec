"""Verification and sampling primitives, and the no-host-sync guarantee of a step."""

import pytest
import torch
from conftest import run_to_completion, tiny_engine, tiny_prompts

import speculative.sampling
import speculative.verify
import workers.verifier
from speculative.config import SamplingParams
from speculative.sampling import ACCEPT_STREAM, SAMPLE_STREAM, sample, target_probs, uniform
from speculative.verify import verify_greedy, verify_sampled
from workers.sync_guard import HostSyncError, no_host_sync


def test_verify_greedy_accepts_longest_matching_prefix():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7], [5, 6, 0]])
    tokens, emitted, _ = verify_greedy(target, drafts)
    assert emitted.tolist() == [4, 2, 1, 3]
    assert [tokens[i, :n].tolist() for i, n in enumerate(emitted.tolist())] == [
        [5, 6, 7, 8],
        [5, 6],
        [5],
        [5, 6, 7],
    ]


def test_verify_sampled_on_one_hot_is_greedy():
    """Greedy rows in a sampled batch are one-hot distributions: the sampled rule must give exactly
    the greedy result, for any uniforms."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, 10, generator=g)
    drafts = torch.where(
        torch.rand(64, 3, generator=g) < 0.6,
        logits[:, :3].argmax(-1),
        torch.randint(0, 10, (64, 3), generator=g),
    )
    probs = target_probs(logits, torch.zeros(64), None, None)
    tokens, emitted, _ = verify_sampled(
        probs, drafts, torch.rand(64, 3, generator=g), torch.rand(64, 4, generator=g)
    )
    g_tokens, g_emitted, _ = verify_greedy(logits.argmax(-1), drafts)
    assert torch.equal(emitted, g_emitted)
    for i, n in enumerate(emitted.tolist()):
        assert tokens[i, :n].tolist() == g_tokens[i, :n].tolist()


def test_verify_greedy_through_a_sibling():
    """K=3, M=2: nodes 0-3 the chain, 4-6 the first siblings at depths 1-3, 7-9 the second ones."""
    target = torch.tensor([[5, 6, 7, 8, 20, 21, 22, 30, 31, 32]]).expand(6, -1)
    drafts = torch.tensor([[5, 0, 7], [5, 0, 7], [5, 6, 7], [0, 6, 7], [5, 6, 0], [0, 0, 0]])
    siblings = torch.tensor(
        [
            [[1, 6, 2], [3, 4, 5]],  # depth 2's first sibling is the target's
            [[1, 2, 3], [4, 5, 6]],  # none is
            [[1, 2, 3], [4, 5, 6]],  # the chain is all accepted
            [[1, 2, 3], [5, 5, 6]],  # depth 1's second sibling
            [[9, 9, 9], [9, 9, 7]],  # depth 3's second sibling
            [[6, 6, 6], [6, 6, 6]],  # a sibling equal to another depth's token
        ]
    )
    tokens, emitted, path = verify_greedy(target, drafts, siblings)
    assert emitted.tolist() == [3, 2, 4, 2, 4, 1]
    assert [tokens[i, :n].tolist() for i, n in enumerate(emitted.tolist())] == [
        [5, 6, 21],
        [5, 6],
        [5, 6, 7, 8],
        [5, 30],
        [5, 6, 7, 32],
        [5],
    ]
    assert [path[i, :n].tolist() for i, n in enumerate(emitted.tolist())] == [
        [0, 1, 5],
        [0, 1],
        [0, 1, 2, 3],
        [0, 7],
        [0, 1, 2, 9],
        [0],
    ]


def test_verify_sampled_through_siblings_keeps_the_distribution():
    """One row repeated: K=1 and two siblings. The first token must follow p at the root, and the
    token after each sibling p at that sibling's node; deliberately non-renormalised sibling
    acceptance (u scaled) must fail the same check."""
    g = torch.Generator().manual_seed(1)
    N, V = 400_000, 6
    # nodes: root, a, b, c
    probs = torch.softmax(torch.randn(1, 4, V, generator=g) * 1.5, -1).expand(N, -1, -1)
    p0 = probs[0, 0]
    a, b, c = p0.argsort(descending=True)[:3].tolist()
    drafts = torch.full((N, 1), a)
    siblings = torch.tensor([[[b]], [[c]]]).view(1, 2, 1).expand(N, -1, -1)

    def run(scale):
        u = lambda *shape: torch.rand(*shape, generator=g)
        return verify_sampled(probs, drafts, u(N, 1), u(N, 2), siblings, u(N, 2, 1) * scale)

    def worst_z(tokens, emitted):
        z = []
        first = torch.bincount(tokens[:, 0], minlength=V).double()
        z.append(((first / N - p0) / (p0 * (1 - p0) / N).sqrt().clamp(min=1e-9)).abs().max())
        for x, node in ((a, 1), (b, 2), (c, 3)):
            rows = tokens[:, 0] == x
            assert (emitted[rows] == 2).all() == (x in (a, b, c))
            second = torch.bincount(tokens[rows, 1], minlength=V).double()
            n, p = rows.sum(), probs[0, node]
            z.append(((second / n - p) / (p * (1 - p) / n).sqrt().clamp(min=1e-9)).abs().max())
        return max(z).item()

    tokens, emitted, path = run(1.0)
    assert worst_z(tokens, emitted) < 5
    assert set(path[tokens[:, 0] == b, 1].tolist()) == {2} and set(
        path[tokens[:, 0] == c, 1].tolist()
    ) == {3}
    assert worst_z(*run(0.7)[:2]) > 8


def test_uniform_is_a_counter_based_stream():
    seeds = torch.tensor([0, 1, 2**62 + 5])
    positions = torch.arange(2000).expand(3, -1)
    u = uniform(seeds, positions, SAMPLE_STREAM)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert torch.equal(u, uniform(seeds, positions, SAMPLE_STREAM))  # reproducible
    # batch independent
    assert torch.equal(u[1:2], uniform(seeds[1:2], positions[:1], SAMPLE_STREAM))
    assert not torch.equal(u, uniform(seeds, positions, ACCEPT_STREAM))
    assert (u[0] != u[1]).float().mean() > 0.99


def test_sample_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]]).expand(1000, -1)
    u = torch.arange(1000) / 1000
    ids = sample(probs * 3, u)  # unnormalised is fine
    assert set(ids.tolist()) == {1, 3} and (ids == 1).sum().item() == 250


@pytest.mark.parametrize("tokens_per_row", [1, 4])
def test_top_k_top_p(tokens_per_row):
    """Top-k, then top-p over the renormalised survivors, per row, for T > 1 as in verification."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).expand(3, tokens_per_row, 4)
    probs = target_probs(
        logits, torch.ones(3), torch.tensor([0, 3, 2]), torch.tensor([0.65, 1.0, 0.55])
    )
    expected = torch.tensor(
        [
            [0.4 / 0.7, 0.3 / 0.7, 0, 0],  # top-p 0.65: {0.4, 0.3}
            [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0],  # top-k 3
            [1.0, 0, 0, 0],  # top-k 2 -> (4/7, 3/7); top-p 0.55 keeps one
        ]
    )
    torch.testing.assert_close(probs, expected.unsqueeze(1).expand(3, tokens_per_row, 4))


@pytest.mark.parametrize(
    "min_p, top_p, expected",
    [
        (0.45, 1.0, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]),  # keeps p >= 0.45 x 0.4
        (0.6, 1.0, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        # then top-p over the survivors (first: three kept)
        (0.3, 0.75, [0.4 / 0.7, 0.3 / 0.7, 0, 0]),
        (0.0, 1.0, [0.4, 0.3, 0.2, 0.1]),
    ],
)
def test_min_p(min_p, top_p, expected):
    # temperature 2 first
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])).expand(1, 2, 4) * 2
    probs = target_probs(
        logits,
        torch.full((1,), 2.0),
        torch.zeros(1, dtype=torch.long),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    torch.testing.assert_close(probs, torch.tensor(expected).expand(1, 2, 4))


def test_rows_without_top_k_top_p_are_not_cut():
    """A row with top_p 1 and no top_k keeps its whole distribution, bit for bit, when another row
    of the step turns the top-k/top-p path on: in float32 the sorted cumulative mass reaches 1.0
    before the tail, and cutting there would make a seeded request depend on its neighbours."""
    logits = torch.randn(2, 1, 49152, generator=torch.Generator().manual_seed(0)) * 4
    temperature = torch.full((2,), 0.7)
    alone = target_probs(logits[:1], temperature[:1], None, torch.ones(1))
    together = target_probs(logits, temperature, torch.tensor([0, 50]), torch.tensor([1.0, 1.0]))
    assert torch.equal(together[:1], alone) and (together[1] > 0).sum() == 50
    with_min_p = target_probs(
        logits,
        temperature,
        torch.tensor([0, 0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.1]),
    )
    assert torch.equal(with_min_p[:1], alone) and 0 < (with_min_p[1] > 0).sum() < 49152


# ---- no host sync inside a step ----


def test_guard_catches_host_syncs():
    x = torch.ones(3)
    for sync in (
        lambda: x.sum().item(),
        lambda: x.tolist(),
        lambda: x.cpu(),
        lambda: x.numpy(),
        lambda: bool(x[0]),
        lambda: int(x[0]),
        lambda: float(x[0]),
    ):
        with pytest.raises(HostSyncError), no_host_sync():
            sync()
    with no_host_sync(enabled=False):
        assert x.sum().item() == 3
    assert x.tolist() == [1.0, 1.0, 1.0]  # the guard restores the methods


CASES = {
    "greedy": SamplingParams(max_tokens=12, ignore_eos=True),
    "sampled": SamplingParams(temperature=0.9, seed=1, max_tokens=12, ignore_eos=True),
    "top-k-top-p": SamplingParams(
        temperature=0.7, top_k=8, top_p=0.9, seed=2, max_tokens=12, ignore_eos=True
    ),
    "min-p-bias-penalties": SamplingParams(
        temperature=0.8,
        min_p=0.1,
        logit_bias={3: 2.0, 40: -1.0},
        seed=4,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        max_tokens=12,
        ignore_eos=True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("drafts", ["none", "chain", "tree"])
def test_steps_run_without_host_sync(tiny_dir, tiny_drafter_dir, case, drafts):
    """Prefill, verification and the draft chain (or tree), in batches that mix request kinds, with
    every host-sync method refused: the run completes and equals the unguarded run."""
    drafter = tiny_drafter_dir if drafts != "none" else "none"
    siblings = 2 if drafts == "tree" else 0
    prompts = tiny_prompts(5, seed=6)
    params = [CASES[case], CASES["greedy"], CASES[case], CASES[case], CASES["greedy"]]
    joins = [0, 0, 1, 3, 4]
    guarded = tiny_engine(tiny_dir, drafter, k=3, max_batch_size=4, draft_siblings=siblings)
    guarded.executor.check_host_sync = True
    out = run_to_completion(guarded, prompts, params, joins)
    ref = run_to_completion(
        tiny_engine(tiny_dir, drafter, k=3, max_batch_size=4, draft_siblings=siblings),
        prompts,
        params,
        joins,
    )
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]
    assert all(len(r.output_ids) == 12 for r in out)


@pytest.mark.parametrize(
    "module, function, params",
    [
        (workers.verifier, "verify_greedy", CASES["greedy"]),
        (speculative.verify, "verify_sampled", CASES["sampled"]),
        (speculative.sampling, "sample", CASES["sampled"]),
    ],
)
def test_guard_catches_a_sync_inside_a_step(
    tiny_dir, tiny_drafter_dir, monkeypatch, module, function, params
):
    """A `.item()` slipped into the step (here into verification or sampling) fails the step loudly
    when the guard is on, and goes unnoticed when it is off."""
    original = getattr(module, function)

    def syncing(*args, **kwargs):
        args[0].sum().item()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, function, syncing)
    engine = tiny_engine(tiny_dir, tiny_drafter_dir, k=2)
    run_to_completion(engine, tiny_prompts(2), params)  # unguarded: the sync goes unnoticed
    engine.executor.check_host_sync = True
    with pytest.raises(HostSyncError, match=r"Tensor.item\(\)"):
        run_to_completion(engine, tiny_prompts(2), params)
