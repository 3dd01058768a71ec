"""Training on several corpora at once (TrainConfig.corpora): each a data directory of parts with
a weight, the sequences an epoch draws from it relative to its size (1: each once, 0.5: a
random half, different every epoch, 2: each twice). A corpus that teaches new kinds of request
(the synthetic set) is mixed with the one the drafter learned from (its distilled responses), so
that it learns the new without forgetting the old. The draw depends only on (seed, epoch): a
resumed or continued run sees the batches an uncut one would."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speculative.train.data import TokenStore, load_data


@dataclass
class Mix:
    bounds: list[int]  # corpus i is sequences bounds[i]..bounds[i + 1] of the joined store
    weights: list[float]
    names: list[str]

    def draw(self, seed: int, epoch: int) -> np.ndarray:
        """The indices of one epoch's sequences: whole copies of each corpus for the integer part
        of its weight, a random subset without repeats for the rest."""
        rng = np.random.default_rng([seed, epoch, 1])
        picks = []
        for lo, hi, weight in zip(self.bounds, self.bounds[1:], self.weights):
            whole, part = divmod(round(weight * (hi - lo)), max(hi - lo, 1))
            picks += [np.arange(lo, hi)] * whole
            picks.append(lo + rng.choice(hi - lo, part, replace=False))
        return np.concatenate(picks)

    def describe(self) -> str:
        sizes = np.diff(self.bounds)
        return ", ".join(
            f"{name}: {n} sequences x {w:g}" for name, n, w in zip(self.names, sizes, self.weights)
        )


def load_corpora(cfg) -> tuple[TokenStore, Mix | None]:
    """The training store: the data directory alone, or every corpus of cfg.corpora joined, with
    the Mix that draws from them."""
    if not cfg.corpora:
        return load_data(cfg.data_dir), None
    stores = [load_data(Path(c.data)) for c in cfg.corpora]
    bounds = np.cumsum([0] + [len(s) for s in stores]).tolist()
    mix = Mix(bounds, [c.weight for c in cfg.corpora], [c.data for c in cfg.corpora])
    return TokenStore.concat(stores), mix
