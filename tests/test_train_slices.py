"""Drafter training in slices that travel (speculative/train/handover.py), on a mix of corpora
(speculative/train/mix.py), with a tiny random target and random token data: a run cut after N
steps and continued from its hand-over equals the uncut run; an optimizer-free bfloat16 hand-over
continues the step, schedule and weights; every hand-over and int8 export file stays under its
cap; the int8 export round-trips; a mix draws whole copies and fresh subsets per epoch."""

import json
import struct

import numpy as np
import pytest
import torch
from conftest import write_tiny_llama
from safetensors.torch import load_file

from deployments.cli import main as cli_main
from speculative.drafter_int8 import dequantize_int8, quantize_int8
from speculative.train.config import TrainConfig
from speculative.train.data import TokenStore, batches, save_parts
from speculative.train.handover import load_split
from speculative.train.mix import Mix
from speculative.train.pipeline import train_drafter

CAP_MB = 0.02  # 20 kB: the fc and head tensors are split by rows


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """A tiny target and two corpora of random sequences (prompt + response)."""
    root = tmp_path_factory.mktemp("slices")
    model = write_tiny_llama(root / "target")
    rng = np.random.default_rng(0)
    dirs = []
    for name, n in (("a", 24), ("b", 12)):
        seqs = [rng.integers(0, 64, rng.integers(20, 60)).tolist() for _ in range(n)]
        save_parts(root / name, TokenStore.from_lists(seqs, [8] * n))
        dirs.append(str(root / name))
    return root, model, dirs


def config(root, model, data, name, **kw) -> TrainConfig:
    fields = dict(
        model=str(model), output=str(root / name), data=data, draft_vocab_size=32, ttt_steps=2,
        lr=3e-3, warmup_steps=2, max_steps=6, batch_tokens=512, checkpoint_every=100,
        device="cpu", export_dtype="float32", export_shard_mb=CAP_MB,
    )  # fmt: skip
    return TrainConfig(**fields | kw)


def exported(path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def data_bytes(file) -> int:
    """A safetensors file's tensor bytes (its size less the JSON header)."""
    with open(file, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    return file.stat().st_size - 8 - header


def test_mix_draws_whole_copies_and_a_fresh_subset_each_epoch():
    mix = Mix(bounds=[0, 10, 30], weights=[2.0, 0.5], names=["a", "b"])
    first, again, second = mix.draw(0, 0), mix.draw(0, 0), mix.draw(0, 1)
    assert np.array_equal(first, again)  # a resumed run draws the same
    for draw in (first, second):
        counts = np.bincount(draw, minlength=30)
        assert (counts[:10] == 2).all()  # weight 2: each twice
        assert counts[10:].sum() == 10 and counts[10:].max() == 1  # 0.5: half, no repeats
    assert not np.array_equal(np.sort(first[20:]), np.sort(second[20:]))  # another half
    store = TokenStore.from_lists([[1] * (5 + i) for i in range(30)], [1] * 30)
    drawn = [i for b in batches(store, 64, 64, seed=0, epoch=0, mix=mix) for i in b]
    assert sorted(drawn) == sorted(first.tolist())


def test_cut_run_continued_from_its_handover_equals_the_uncut_run(corpora):
    """Three steps, the hand-over (float32, with AdamW's moments), the checkpoint directory gone
    (a fresh machine), three more: the uncut six steps' drafter, bit for bit."""
    root, model, (data, _) = corpora
    uncut = train_drafter(config(root, model, data, "uncut"))
    handover = root / "handover"
    cut = config(root, model, data, "cut", handover=str(handover), max_steps_this_run=3)
    assert train_drafter(cut)["step"] == 3
    files = sorted(handover.glob("*.safetensors"))
    assert {f.name.split("-")[0] for f in files} == {"weights", "adam"}
    assert all(data_bytes(f) <= CAP_MB * 1e6 for f in files)
    assert any("@" in n for f in files for n in load_file(str(f)))  # tensors split by rows
    for path in root.glob("cut.ckpt*"):
        __import__("shutil").rmtree(path)
    summary = train_drafter(cut.model_copy(update={"max_steps_this_run": None}))
    assert summary["step"] == 6 and summary["metrics"] == uncut["metrics"]
    ours, theirs = exported(root / "cut"), exported(root / "uncut")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_optimizer_free_bfloat16_handover_continues_step_and_weights(corpora, tmp_path):
    root, model, (data, _) = corpora
    handover = tmp_path / "handover"
    cfg = config(
        tmp_path, model, data, "slice", handover=str(handover), max_steps_this_run=3,
        handover_dtype="bfloat16", handover_optimizer=False,
    )  # fmt: skip
    train_drafter(cfg)
    weights = load_split(handover, "weights")
    assert not list(handover.glob("adam-*")) and weights["fc.weight"].dtype == torch.bfloat16
    state = json.loads((handover / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["max_steps"] == 6
    for path in tmp_path.glob("slice.ckpt*"):
        __import__("shutil").rmtree(path)
    continued = cfg.model_copy(update={"max_steps_this_run": 1, "handover": str(handover)})
    summary = train_drafter(continued)
    assert summary["step"] == 4 and summary["max_steps"] == 6  # the schedule goes on
    # the continued run started from the handed-over weights: one step moved them only a little
    after = exported(tmp_path / "slice")["fc.weight"]
    start = weights["fc.weight"].float()
    assert 0 < (after - start).abs().max() < 0.1 * start.abs().max()


def test_int8_export_round_trips_under_its_cap(corpora, tmp_path):
    """The shipped layout: int8 rows and a scale each, every file under the cap, dequantized
    within half a step of each row's scale of the float32 weights, and quantizing the
    dequantized weights again gives the same int8 bytes (re-exporting loses nothing more)."""
    root, model, (data, _) = corpora
    train_drafter(config(tmp_path, model, data, "int8", max_steps=2, export_dtype="int8"))
    files = sorted((tmp_path / "int8").glob("*.safetensors"))
    assert len(files) > 1 and all(data_bytes(f) <= CAP_MB * 1e6 for f in files)
    stored = exported(tmp_path / "int8")
    assert stored["fc.weight"].dtype == torch.int8
    weights = exported(tmp_path / "int8.ckpt")  # the float32 checkpoint it was exported from
    restored = dequantize_int8(stored)
    for name, t in stored.items():
        if t.dtype == torch.int8:
            scale = stored[name + "_scale"]
            assert ((restored[name] - weights[name]).abs() <= scale / 2 + 1e-6).all(), name
            again = quantize_int8({name: restored[name]})
            assert torch.equal(again[name], t), name


def test_cli_trains_on_weighted_corpora(corpora, tmp_path, capsys):
    root, model, dirs = corpora
    args = ["train-drafter", "--model", str(model), "-o", str(tmp_path / "mixed"), "--device",
            "cpu", "--max-steps", "2", "--draft-vocab-size", "32", "--ttt-steps", "2",
            "--corpus", f"{dirs[0]}=0.5", dirs[1]]  # fmt: skip
    cli_main(args)
    saved = json.loads((tmp_path / "mixed" / "training_config.json").read_text())
    assert saved["corpora"] == [{"data": dirs[0], "weight": 0.5}, {"data": dirs[1], "weight": 1.0}]
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["step"] == 2
    with pytest.raises(SystemExit):
        cli_main(args[:-3] + ["--corpus", f"{dirs[0]}=half"])
    err = capsys.readouterr().err
    assert f"'{dirs[0]}=half': the weight after '=' must be a number" in err
