"""Filters for synthesized user turns: exact and near-duplicate removal (MinHash over word
shingles) and decontamination against benchmark prompts (a shared 13-word run, the rule the
training prompts in shared data were built with)."""

import re
import zlib

import numpy as np

from speculative.jsonl import read_rows

CONTAMINATION_NGRAM = 13
# items shorter than the n-gram: equal, or (with at least this many words) contained
MIN_CONTAINED_WORDS = 6
SHINGLE_WORDS = 5
NUM_BANDS, ROWS_PER_BAND = 16, 4  # 64 MinHash values: Jaccard 0.7 is found with p ~ 0.99
_PRIME = (1 << 61) - 1


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words."""
    return re.findall(r"[a-z0-9]+", text.lower())


def normalised(text: str) -> str:
    return " ".join(words(text))


def prompt_texts(row) -> list[str]:
    """The prompts of a benchmark row: "prompt", "question", "instruction" or MT-Bench "turns"."""
    if not isinstance(row, dict):
        return []
    texts = [row.get(k) for k in ("prompt", "question", "instruction")]
    texts += row.get("turns") or []
    return [t for t in texts if isinstance(t, str) and t.strip()]


def read_benchmark_prompts(files: list[str]) -> list[str]:
    return [t for f in files for _, row in read_rows(f) for t in prompt_texts(row)]


class Decontaminator:
    """Whether a text shares a 13-word run with a benchmark prompt (or holds a short one)."""

    def __init__(self, benchmark_prompts: list[str]):
        self.ngrams: set[tuple[str, ...]] = set()
        self.short: set[str] = set()
        for text in benchmark_prompts:
            w = words(text)
            if len(w) >= CONTAMINATION_NGRAM:
                self.ngrams.update(_ngrams(w, CONTAMINATION_NGRAM))
            elif w:
                self.short.add(" ".join(w))

    def __len__(self) -> int:
        return len(self.ngrams) + len(self.short)

    def is_contaminated(self, text: str) -> bool:
        w = words(text)
        if any(g in self.ngrams for g in _ngrams(w, CONTAMINATION_NGRAM)):
            return True
        joined = " ".join(w)
        return any(
            joined == s or (len(s.split()) >= MIN_CONTAINED_WORDS and f" {s} " in f" {joined} ")
            for s in self.short
        )


def _ngrams(w: list[str], n: int):
    return (tuple(w[i : i + n]) for i in range(len(w) - n + 1))


class DuplicateFilter:
    """Keeps a text unless its normalised form was kept before or its shingles' estimated Jaccard
    similarity with a kept text reaches `threshold` (MinHash candidates by band, then the exact
    Jaccard of the shingle sets)."""

    def __init__(self, threshold: float, seed: int = 0):
        self.threshold = threshold
        rng = np.random.default_rng(seed)
        n = NUM_BANDS * ROWS_PER_BAND
        self.a = rng.integers(1, _PRIME, n, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, n, dtype=np.uint64)
        self.exact: set[str] = set()
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.shingles: list[frozenset[int]] = []

    def add(self, text: str) -> bool:
        """True (and remembered) when `text` is new."""
        key = normalised(text)
        if not key or key in self.exact:
            return False
        shingles = _shingles(key.split())
        bands = self._bands(shingles)
        candidates = {i for band in bands for i in self.buckets.get(band, ())}
        if any(_jaccard(shingles, self.shingles[i]) >= self.threshold for i in candidates):
            return False
        self.exact.add(key)
        for band in bands:
            self.buckets.setdefault(band, []).append(len(self.shingles))
        self.shingles.append(shingles)
        return True

    def _bands(self, shingles: frozenset[int]) -> list[tuple[int, bytes]]:
        h = np.fromiter(shingles, dtype=np.uint64)[:, None]  # [S, 1]
        # (a*h + b) mod 2^64 is a fine hash family for candidate search (not for the decision)
        signature = (h * self.a + self.b).min(axis=0)  # [64]
        rows = signature.reshape(NUM_BANDS, ROWS_PER_BAND)
        return [(i, rows[i].tobytes()) for i in range(NUM_BANDS)]


def _shingles(w: list[str]) -> frozenset[int]:
    n = min(SHINGLE_WORDS, len(w))
    return frozenset(zlib.crc32(" ".join(w[i : i + n]).encode()) for i in range(len(w) - n + 1))


def _jaccard(x: frozenset, y: frozenset) -> float:
    return len(x & y) / len(x | y)
