"""What `num_draft_tokens: auto` measures and picks each step: the acceptance at each draft
position (per request and overall, exponentially decayed) and the cost of a decode step at each
batch size and K (profiled at start on the real runner, workers/step_costs.py, and kept current
from the steps' timings); speculative/draft_length.py picks the K from them."""

from collections import deque

from speculative.draft_length import bucket, choose_draft_length, expected_tokens

DECAY_REQUEST = 0.9  # per verify of the request: about its last ten steps count
DECAY_OVERALL = 0.99  # per verified row: about the last hundred rows count
# a request's own estimate starts as this many trials at the overall rate: its own verifies soon
# outweigh the other requests' (after a run of always-wrong requests, a probe's success counts)
PRIOR_WEIGHT = 1.0
# before any draft at a position is verified: what a drafter trained for the target reaches
# (BENCHMARKS.md: SmolLM2's per-position acceptance is 0.6-0.8); one trial's weight
PRIOR_RATE = 0.7
# a new step timing moves every cost of its batch size by this share of its ratio to its own
# (the load on the machine changes them alike), and its own K's by SHAPE_WEIGHT more: the costs'
# ratios across K, which pick the K, stay the profile's but for a slow drift
LEVEL_WEIGHT = 0.2
SHAPE_WEIGHT = 0.02
# steps choosing K=0 after which one step drafts 1, to measure the acceptance again (plain
# decoding measures none)
PROBE_EVERY = 16
# an unmeasured (batch, K) cost: a measured one of the batch scaled by (1 + this x K)
DRAFT_SHARE = 0.15


class DecayedAcceptance:
    """Exponentially decayed trials and hits of the drafts at each position 1..K: a draft is
    tried where the row verifies it (within the row's limit) and every draft before it was
    accepted."""

    def __init__(self, K: int):
        self.hits, self.trials = [0.0] * K, [0.0] * K

    def add(self, accepted: int, limit: int, decay: float) -> None:
        self.hits = [h * decay for h in self.hits]
        self.trials = [t * decay for t in self.trials]
        for j in range(min(accepted + 1, limit)):
            self.trials[j] += 1.0
            self.hits[j] += float(j < accepted)

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """Conditional acceptance per position, each starting from `prior` as `weight` trials."""
        return [(h + weight * p) / (t + weight) for h, t, p in zip(self.hits, self.trials, prior)]

    def chained_rates(self, first: float, weight: float) -> list[float]:
        """The same, position 1 starting from `first` and each later one from the rate before
        it: a position never tried (beyond every K chosen so far) is taken to accept as the last
        one tried, so a longer draft gets tried where the shorter ones are accepted."""
        rates, prior = [], first
        for h, t in zip(self.hits, self.trials):
            prior = (h + weight * prior) / (t + weight)
            rates.append(prior)
        return rates


class DraftTuner:
    def __init__(self, K: int, costs: dict[tuple[int, int], float] | None = None):
        self.K = K
        self.overall = DecayedAcceptance(K)
        self.costs = dict(costs or {})  # (bucket, k) -> seconds of a decode step
        self.steps_at_zero = 0
        self.num_steps_by_k = [0] * (K + 1)  # how often each K was chosen (metrics, bench)
        self.recent = deque(maxlen=32)  # the latest choices, last last

    def observe(self, request, accepted: int, limit: int) -> None:
        """A verified row: `accepted` of its `limit` drafts."""
        if limit <= 0:
            return
        self.overall.add(accepted, limit, DECAY_OVERALL)
        if request.is_auto_k:
            if request.acceptance is None:
                request.acceptance = DecayedAcceptance(self.K)
            request.acceptance.add(accepted, limit, DECAY_REQUEST)

    def observe_cost(self, batch: int, k: int, seconds: float) -> None:
        if seconds <= 0:  # no timing (a result that measured none): nothing to learn from
            return
        b = bucket(batch)
        if self.costs.get((b, k), 0.0) <= 0:
            self.costs[b, k] = seconds
            return
        ratio = seconds / self.costs[b, k]
        level = 1.0 + LEVEL_WEIGHT * (ratio - 1.0)
        for key in self.costs:
            if key[0] == b:
                self.costs[key] *= level
        self.costs[b, k] *= 1.0 + SHAPE_WEIGHT * (ratio - 1.0)

    def rates(self, request) -> list[float]:
        overall = self.overall.chained_rates(PRIOR_RATE, 1.0)
        if request is None or request.acceptance is None:
            return overall
        return request.acceptance.rates(overall, PRIOR_WEIGHT)

    def step_cost(self, batch: int, k: int) -> float:
        b = bucket(batch)
        if (b, k) in self.costs:
            return self.costs[b, k]
        measured = [(j, s) for (bb, j), s in self.costs.items() if bb == b]
        if not measured:  # relative costs suffice within a batch size
            return 1.0 + DRAFT_SHARE * k
        j, seconds = min(measured, key=lambda m: abs(m[0] - k))
        return seconds * (1.0 + DRAFT_SHARE * k) / (1.0 + DRAFT_SHARE * j)

    def choose(self, auto_rows: list, fixed_rows: list, batch: int) -> int:
        """The K of a step's auto rows, beside rows of fixed K (Requests), `batch` rows in all."""
        overall = self.rates(None)
        fixed = sum(expected_tokens(overall, r.num_draft_tokens) for r in fixed_rows)
        seconds = [self.step_cost(batch, k) for k in range(self.K + 1)]
        k = choose_draft_length([self.rates(r) for r in auto_rows], seconds, fixed)
        self.steps_at_zero = self.steps_at_zero + 1 if k == 0 else 0
        if self.steps_at_zero > PROBE_EVERY:
            k, self.steps_at_zero = 1, 0
        self.num_steps_by_k[k] += 1
        self.recent.append(k)
        return k

    def assign(self, plan, rows: list, decodes: list) -> None:
        """Per-row K in the plan (speculative/plan.py): each row drafts its own K (auto rows this
        step's pick), and each decode row's verify checks what its previous step drafted. Lists
        only where some row differs from the engine's K."""
        limits = [r.num_pending_drafts for r in decodes]
        auto = [r for r in rows if r.is_auto_k]
        k_auto = self.choose(auto, [r for r in rows if not r.is_auto_k], len(rows)) if auto else 0
        counts = [k_auto if r.is_auto_k else r.num_draft_tokens for r in rows]
        for r, count in zip(rows, counts):
            r.num_pending_drafts = count
        if any(c != self.K for c in counts):
            plan.draft_counts = counts
        if any(n != self.K for n in limits):
            plan.draft_limits = limits

    def observe_step(self, plan, result) -> None:
        """A decode step's timing, as the cost of its batch size at its largest K."""
        if plan.prefills:
            return
        k = max(plan.draft_counts) if plan.draft_counts else self.K
        self.observe_cost(len(plan.decode_slots), k, max(result.execute_s, result.device_s))
