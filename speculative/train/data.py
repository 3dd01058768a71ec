"""Training data: prompts, self-distilled sequences (prompt + the target's own response) stored
as flat token arrays with offsets in safetensors, the draft vocabulary, and length-bucketed
batches. Target features and distributions are not stored: they are recomputed per batch.

The data directory holds the distilled sequences in parts (part-00000.safetensors, ...), one
sequence per prompt of the distillation order, in that order. A distillation run continues the
order after the prompts the parts already hold, so jobs of a few minutes each (the H200 machine's
limit) grow one dataset, and each part stays small enough to travel between machines."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file


@dataclass
class TokenStore:
    tokens: np.ndarray  # [num_tokens] int32, sequences back to back
    offsets: np.ndarray  # [num_seqs + 1] int64
    prompt_lens: np.ndarray  # [num_seqs] int32

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_lists(cls, seqs: list[list[int]], prompt_lens: list[int]) -> "TokenStore":
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        flat = (
            np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
            if seqs
            else np.zeros(0, np.int32)
        )
        return cls(flat, offsets, np.asarray(prompt_lens, dtype=np.int32))

    @classmethod
    def concat(cls, stores: list["TokenStore"]) -> "TokenStore":
        offsets = [np.zeros(1, np.int64)]
        for store in stores:
            offsets.append(store.offsets[1:] + offsets[-1][-1])
        return cls(
            np.concatenate([s.tokens for s in stores] + [np.zeros(0, np.int32)]),
            np.concatenate(offsets),
            np.concatenate([s.prompt_lens for s in stores] + [np.zeros(0, np.int32)]),
        )

    def slice(self, start: int, end: int) -> "TokenStore":
        offsets = self.offsets[start : end + 1]
        return TokenStore(
            self.tokens[offsets[0] : offsets[-1]], offsets - offsets[0], self.prompt_lens[start:end]
        )

    def save(self, path: Path) -> None:
        """uint16 tokens when the vocabulary fits (half the bytes: parts travel between machines).
        Written under another name and renamed: a killed write leaves no part cut short."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokens = (
            self.tokens.astype(np.uint16)
            if self.tokens.size and self.tokens.max() < 2**16
            else self.tokens
        )
        tmp = path.with_name(path.name + ".tmp")
        save_file(
            {"tokens": tokens, "offsets": self.offsets, "prompt_lens": self.prompt_lens}, str(tmp)
        )
        tmp.rename(path)

    @classmethod
    def load(cls, path: Path) -> "TokenStore":
        try:
            t = load_file(str(path))
            return cls(t["tokens"].astype(np.int32), t["offsets"], t["prompt_lens"])
        except (SafetensorError, KeyError) as e:
            raise ValueError(
                f"data part {path} is unreadable ({e}): cut short by a killed copy? Copy it "
                "again, or delete it and the parts after it and distil them again"
            ) from e


# 12 MB in uint16: a file that comes back from the H200 machine may have at most 16 MiB
MAX_PART_TOKENS = 6_000_000


def data_parts(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("part-*.safetensors"))


def load_data(directory: Path) -> TokenStore:
    """Every part of a data directory, in order, as one store."""
    parts = data_parts(directory)
    if not parts:
        raise FileNotFoundError(f"no self-distilled data (part-*.safetensors) in {directory}")
    missing = sorted(
        {f"part-{i:05d}.safetensors" for i in range(len(parts))} - {p.name for p in parts}
    )
    # the parts hold the order's prompts in turn: without one, the rest are off by its size
    if missing:
        raise ValueError(
            f"data directory {directory} lacks {', '.join(missing)} before "
            f"{parts[-1].name}: restore the parts, or move those after the gap away"
        )
    return TokenStore.concat([TokenStore.load(p) for p in parts])


def save_parts(
    directory: Path, store: TokenStore, max_part_tokens: int = MAX_PART_TOKENS
) -> list[Path]:
    """Append `store` to the directory as parts of at most `max_part_tokens` tokens each."""
    parts = data_parts(directory)
    index = int(parts[-1].stem.removeprefix("part-")) + 1 if parts else 0
    paths, start = [], 0
    while start < len(store):
        end = start + 1
        while end < len(store) and store.offsets[end + 1] - store.offsets[start] <= max_part_tokens:
            end += 1
        paths.append(Path(directory) / f"part-{index + len(paths):05d}.safetensors")
        store.slice(start, end).save(paths[-1])
        start = end
    return paths


def draft_vocab(
    store: TokenStore, vocab_size: int, draft_vocab_size: int, always: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The most frequent response tokens -> (d2t [Vd] int64 offsets, t2d [V] bool, coverage).
    Draft ids keep the target order, so target id = draft id + d2t[draft id]."""
    responses = [store.seq(i)[store.prompt_lens[i] :] for i in range(len(store))]
    counts = np.bincount(np.concatenate(responses + [np.zeros(0, np.int32)]), minlength=vocab_size)
    priority = counts.copy()
    priority[list(always)] = counts.max() + 1
    chosen = np.sort(np.argsort(-priority, kind="stable")[:draft_vocab_size])
    coverage = float(counts[chosen].sum() / max(counts.sum(), 1))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(chosen)] = True
    d2t = torch.from_numpy(chosen).long() - torch.arange(draft_vocab_size)
    return d2t, t2d, coverage


# Batches are padded to a multiple of this many tokens, so that few shapes occur. Padded to its
# longest row only, every batch of a 6M-token store's first epoch had a new length, and that epoch
# ran at 1.5 steps/s on the H200 against 8 afterwards (per-shape setup on the GPU, ~0.5 s a shape:
# inferred from those rates, not profiled).
PAD_MULTIPLE = 64


def padded_len(n, multiple: int = PAD_MULTIPLE):
    return -(-n // multiple) * multiple


def batches(
    store: TokenStore, batch_tokens: int, max_seq_len: int, seed: int, epoch: int, mix=None
) -> list[list[int]]:
    """Length-bucketed batches of sequence indices, each at most `batch_tokens` padded tokens (rows
    padded as `collate` pads them), in a shuffled order that depends only on (seed, epoch), so a
    resumed run sees the same batches. With a `Mix`, the epoch's draw of its corpora."""
    rng = np.random.default_rng([seed, epoch])
    pool = np.arange(len(store)) if mix is None else mix.draw(seed, epoch)
    lengths = np.minimum(store.lengths[pool], max_seq_len)
    order = np.argsort(lengths + rng.random(len(lengths)), kind="stable")  # ties shuffled
    lengths = padded_len(lengths)
    out, current = [], []
    for j in order:  # ascending lengths: the newest row is the batch's longest
        if current and lengths[j] * (len(current) + 1) > batch_tokens:
            out.append(current)
            current = []
        current.append(int(pool[j]))
    if current:
        out.append(current)
    rng.shuffle(out)
    return out


def collate(
    store: TokenStore,
    indices: list[int],
    max_seq_len: int,
    multiple: int = PAD_MULTIPLE,
    pad_id: int = 0,
):
    """-> ids [B, T] int64 with T padded to `multiple`, lengths [B], prompt_lens [B] (sequences cut
    to max_seq_len)."""
    seqs = [store.seq(i)[:max_seq_len] for i in indices]
    T = padded_len(max(len(s) for s in seqs), multiple)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
    lengths = torch.tensor([len(s) for s in seqs])
    prompt_lens = torch.tensor([int(store.prompt_lens[i]) for i in indices])
    return ids, lengths, prompt_lens
