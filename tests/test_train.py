"""Drafter training on CPU: the TTT mask, distillation in parts, a tiny end-to-end run
(self-distillation through the engine, training, resume, export) and the exported drafter's
acceptance against a random one."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_llama

from speculative.config import EngineConfig, SamplingParams
from speculative.drafter_format import (
    drafter_config_for,
    random_drafter_state,
    save_drafter,
)
from speculative.drafter_int8 import dequantize_int8
from speculative.engine.llm_engine import LLMEngine, encode_prompt
from speculative.train import checkpoint, trainer
from speculative.train import data as train_data
from speculative.train.config import DistillConfig, TrainConfig
from speculative.train.data import (
    PAD_MULTIPLE,
    TokenStore,
    batches,
    collate,
    data_parts,
    load_data,
    save_parts,
)
from speculative.train.distill import (
    distill_order,
    length_sorted_chunks,
    prompt_order,
    self_distill,
    self_distill_in_processes,
)
from speculative.train.drafter_init import init_drafter, load_target
from speculative.train.pipeline import train_drafter
from speculative.train.trainer import train_step
from speculative.train.ttt import loss_rows, ttt_loss, ttt_mask
from workers.models import ModelConfig, load_config
from workers.models.loader import load_tokenizer

QUESTIONS = [
    "How many legs do 3 cats have?",
    "What is 7 times 8?",
    "Name a red fruit.",
    "Spell the word cat.",
    "Count from one to five.",
    "Is the sky blue?",
    "What is 10 minus 4?",
    "Say hello twice.",
]


def questions_file(directory):
    """QUESTIONS as a JSONL prompt file in `directory`."""
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    return path


def test_ttt_mask_matches_inference_cache():
    # depth 2, T 5: the query at t reads depth-0 keys <= t-2, the depth-1 key at t-1, its own at t
    m = ttt_mask(5, 2, "cpu").view(5, 3, 5)
    t = 4
    assert m[t, 0].tolist() == [True, True, True, False, False]
    assert m[t, 1].tolist() == [False, False, False, True, False]
    assert m[t, 2].tolist() == [False, False, False, False, True]
    assert m.sum(dim=(1, 2)).min() >= 1  # every row reads at least its own key: no NaN rows


def test_length_sorted_chunks():
    """Prompts over the limit are dropped; each chunk of the kept ones is sorted by length, and
    the chunks keep the input's order (so a time limit still sees the shuffled mix)."""
    prompts = [[0] * n for n in (5, 2, 9, 4, 7, 1, 3, 8)]
    out = [len(p) for p in length_sorted_chunks(iter(prompts), chunk=3, max_len=8)]
    assert out == [2, 4, 5, 1, 3, 7, 8]


def test_prompt_order_puts_long_prompts_first():
    texts = [f"{i}" * n for i, n in enumerate([5, 30, 2, 40, 7, 25, 3, 35])]
    plain = prompt_order(texts, DistillConfig(seed=3))
    assert sorted(plain) == sorted(texts) and plain == prompt_order(texts, DistillConfig(seed=3))
    long_first = prompt_order(texts, DistillConfig(seed=3, long_prompts_first_chars=20))
    assert [len(t) >= 20 for t in long_first] == [True] * 4 + [False] * 4
    # the shuffled order within each group
    assert [t for t in plain if len(t) >= 20] == long_first[:4]
    assert [t for t in plain if len(t) < 20] == long_first[4:]


def identity_head(h: torch.Tensor) -> torch.Tensor:
    """An LM head for tests whose drafter hiddens are the logits themselves."""
    return h


def test_ttt_loss_weighs_prompt_positions():
    """Rows whose next token is in the prompt count only with prompt_weight > 0, scaled by it."""
    torch.manual_seed(0)
    B, T, V = 2, 12, 7
    probs_all = torch.softmax(torch.randn(B * T, V), -1)
    hiddens = [torch.randn(B, T, V), torch.randn(B, T, V)]
    changed = [x.clone() for x in hiddens]
    for x in changed:
        x[:, :3] += 5 * torch.randn(B, 3, V)  # rows t < 3: x[t+1] is a prompt token in both rows

    def loss(hiddens, lengths, prompt_lens, prompt_weight=0.0):
        rows, row_weight = loss_rows(
            torch.tensor(lengths), torch.tensor(prompt_lens), T, prompt_weight
        )
        probs = probs_all[rows + 1]
        return ttt_loss(
            hiddens, identity_head, probs, torch.ones(len(rows)), rows, row_weight, 0.8
        )[0]

    assert torch.equal(loss(hiddens, [12, 10], [6, 4]), loss(changed, [12, 10], [6, 4]))
    assert not torch.equal(
        loss(hiddens, [12, 10], [6, 4], 0.5), loss(changed, [12, 10], [6, 4], 0.5)
    )
    # prompt-only sequences (prompt length = length) count with the weight and nothing else
    assert loss(hiddens, [12, 10], [12, 10]) == 0
    half, full = loss(hiddens, [12, 10], [12, 10], 0.5), loss(hiddens, [12, 10], [12, 10], 1.0)
    assert torch.isclose(2 * half, full) and full > 0
    # rows whose x[t+2] does not exist are never read: the last two of each sequence
    rows, _ = loss_rows(torch.tensor([12, 10]), torch.tensor([6, 4]), T)
    assert (rows % T).tolist() == list(range(5, 10)) + list(range(3, 8))


def old_ttt_loss(logits, target_probs, is_in_draft, lengths, prompt_lens, decay, prompt_weight):
    """The loss as it was defined before commit 9579d71, over every row of the padded
    batch: the reference."""
    B, T, _ = target_probs.shape
    t = torch.arange(T).view(1, T)
    probs_next = target_probs.roll(-1, dims=1)
    usable = (t + 2 <= lengths.view(B, 1) - 1) & is_in_draft.roll(-1, dims=1)
    is_response = t + 1 >= prompt_lens.view(B, 1)
    weight = (usable & is_response).float() + prompt_weight * (usable & ~is_response).float()
    total, accuracies = 0.0, []
    for depth, depth_logits in enumerate(logits):
        w = weight * (t >= depth)
        count = (w > 0).float().sum().clamp(min=1)
        ce = -(probs_next * torch.log_softmax(depth_logits.float(), dim=-1)).sum(-1)
        total = total + decay**depth * (ce * w).sum() / count
        accuracies.append(
            ((depth_logits.argmax(-1) == probs_next.argmax(-1)).float() * (w > 0)).sum() / count
        )
    return total, torch.stack(accuracies)


@pytest.mark.parametrize("prompt_weight", [0.0, 0.3])
def test_loss_on_selected_rows_equals_loss_over_every_row(prompt_weight):
    """The loss read at `loss_rows` only (the target's distributions taken at rows + 1) equals the
    loss over the whole padded batch with the target's distributions rolled by one position."""
    torch.manual_seed(2)
    B, T, V, depths = 3, 16, 11, 4
    # one row is prompt only
    lengths, prompt_lens = torch.tensor([16, 9, 12]), torch.tensor([5, 9, 3])
    logits = [torch.randn(B, T, V) for _ in range(depths)]
    probs = torch.softmax(2 * torch.randn(B, T, V), -1)
    is_in_draft = torch.rand(B, T) > 0.2
    ref_loss, ref_acc = old_ttt_loss(
        logits, probs, is_in_draft, lengths, prompt_lens, 0.8, prompt_weight
    )
    rows, row_weight = loss_rows(lengths, prompt_lens, T, prompt_weight)
    loss, acc = ttt_loss(
        logits,
        identity_head,
        probs.flatten(0, 1)[rows + 1],
        is_in_draft.flatten()[rows + 1],
        rows,
        row_weight,
        0.8,
    )
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(acc, ref_acc)
    assert ref_acc.max() > 0 and ref_loss > 0


def test_distillation_keeps_undistilled_prompts(tmp_path):
    """With keep_undistilled_prompts, prompts past num_prompts become response-free sequences."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    engine = LLMEngine(
        EngineConfig(
            model=str(model), drafter="none", max_batch_size=4, max_model_len=256, device="cpu"
        )
    )
    cfg = DistillConfig(
        prompt_files=[str(prompts)],
        num_prompts=3,
        max_tokens=8,
        sampled_fraction=0.0,
        max_batch_size=4,
        keep_undistilled_prompts=True,
    )
    store = self_distill(engine, cfg)
    encoded = sorted(tuple(encode_prompt(engine.tokenizer, q)) for q in QUESTIONS)
    assert (
        sorted(tuple(store.seq(i)[: store.prompt_lens[i]].tolist()) for i in range(len(store)))
        == encoded
    )
    responses = store.lengths - store.prompt_lens
    assert (responses > 0).sum() == 3 and (responses == 0).sum() == len(QUESTIONS) - 3


def test_distillation_continues_in_parts(tmp_path):
    """Each distill-only run adds a part that continues the prompt order where the earlier parts
    stopped: every prompt once across the parts, and nothing more once the order is used up; with
    skip_prompts, a run continues the order of parts it does not have."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    cfg = TrainConfig(
        model=str(model),
        output=str(tmp_path / "drafter"),
        data=str(tmp_path / "data"),
        device="cpu",
        distill=DistillConfig(
            prompt_files=[str(prompts)],
            num_prompts=3,
            max_tokens=8,
            sampled_fraction=0.0,
            max_batch_size=4,
            max_prompt_len=128,
        ),
    )
    first = train_drafter(cfg, distill_only=True)
    assert first["num_parts"] == 1 and first["num_sequences"] == 3
    everything = cfg.model_copy(
        update={"distill": cfg.distill.model_copy(update={"num_prompts": 100})}
    )
    assert train_drafter(everything, distill_only=True)["num_sequences"] == len(QUESTIONS)
    # nothing left: no third part
    assert train_drafter(everything, distill_only=True)["num_parts"] == 2
    parts = [TokenStore.load(p) for p in data_parts(tmp_path / "data")]
    tokenizer = LLMEngine(
        EngineConfig(model=str(model), drafter="none", device="cpu", max_batch_size=1)
    ).tokenizer
    prompts_of = [
        [tuple(s.seq(i)[: s.prompt_lens[i]].tolist()) for i in range(len(s))] for s in parts
    ]
    assert len(prompts_of[0]) == 3 and len(prompts_of[1]) == len(QUESTIONS) - 3
    assert sorted(prompts_of[0] + prompts_of[1]) == sorted(
        tuple(encode_prompt(tokenizer, q)) for q in QUESTIONS
    )
    assert all((s.lengths > s.prompt_lens).all() for s in parts)
    data = load_data(tmp_path / "data")
    assert [tuple(data.seq(i).tolist()) for i in range(len(data))] == [
        tuple(s.seq(i).tolist()) for s in parts for i in range(len(s))
    ]
    # without the first part, skip_prompts continues the order where it
    # stopped: the second part again
    lost = everything.model_copy(
        update={
            "data": str(tmp_path / "data2"),
            "distill": everything.distill.model_copy(update={"skip_prompts": 3}),
        }
    )
    assert train_drafter(lost, distill_only=True)["num_sequences"] == len(QUESTIONS) - 3
    again = TokenStore.load(data_parts(tmp_path / "data2")[0])
    assert [again.seq(i).tolist() for i in range(len(again))] == [
        parts[1].seq(i).tolist() for i in range(len(parts[1]))
    ]


def test_distillation_passes(tmp_path):
    """With two passes the order runs twice, continuing across parts: the first pass greedy, the
    second sampled, each prompt once per pass."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    n = len(QUESTIONS)
    distill = DistillConfig(
        prompt_files=[str(prompts)],
        num_prompts=n + 3,
        num_passes=2,
        max_tokens=8,
        sampled_fraction=0.0,
        temperature=1.5,
        max_batch_size=4,
        max_prompt_len=128,
    )
    cfg = TrainConfig(
        model=str(model),
        output=str(tmp_path / "drafter"),
        data=str(tmp_path / "data"),
        device="cpu",
        distill=distill,
    )
    assert train_drafter(cfg, distill_only=True)["num_sequences"] == n + 3  # into the second pass
    everything = cfg.model_copy(update={"distill": distill.model_copy(update={"num_prompts": 100})})
    assert train_drafter(everything, distill_only=True)["num_sequences"] == 2 * n
    data = load_data(tmp_path / "data")
    seqs = [data.seq(i).tolist() for i in range(len(data))]
    prompts_of = [s[:p] for s, p in zip(seqs, data.prompt_lens.tolist())]
    assert prompts_of[n:] == prompts_of[:n]  # the same order again
    engine = LLMEngine(
        EngineConfig(model=str(model), drafter="none", device="cpu", max_batch_size=4)
    )
    greedy = [
        r.prompt_ids + r.output_ids
        for r in engine.generate(prompts_of[:n], SamplingParams(max_tokens=8))
    ]
    eos = engine.tokenizer.eos_token_id
    assert [s[: len(g)] for s, g in zip(seqs[:n], greedy)] == greedy and all(
        s[len(g) :] in ([], [eos]) for s, g in zip(seqs[:n], greedy)
    )
    # sampled at 1.5: mostly other text
    assert sum(s != f for s, f in zip(seqs[n:], seqs[:n])) >= n // 2
    with pytest.raises(ValueError, match="num_passes"):
        DistillConfig(num_passes=2, keep_undistilled_prompts=True)


def test_distillation_in_processes_equals_one_engine(tmp_path):
    """Engines in two processes distil what one engine does, sequence for sequence and in the same
    order, the sampled second pass included (each request has its own seed); with num_prompts
    short of the order, they take its first prompts."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    distill = DistillConfig(
        prompt_files=[str(prompts)],
        num_prompts=len(QUESTIONS) + 5,
        num_passes=2,
        max_tokens=8,
        sampled_fraction=0.0,
        temperature=1.5,
        max_batch_size=2,
        max_prompt_len=128,
    )
    seqs = []
    for workers in (1, 2):
        cfg = TrainConfig(
            model=str(model),
            output=str(tmp_path / "drafter"),
            data=str(tmp_path / f"data{workers}"),
            device="cpu",
            distill=distill.model_copy(update={"num_workers": workers}),
        )
        assert train_drafter(cfg, distill_only=True)["num_sequences"] == len(QUESTIONS) + 5
        data = load_data(tmp_path / f"data{workers}")
        seqs.append([(data.seq(i).tolist(), int(data.prompt_lens[i])) for i in range(len(data))])
    assert seqs[1] == seqs[0]
    # every prompt, 5 of them twice
    assert len({tuple(s[:p]) for s, p in seqs[0]}) == len(QUESTIONS)


def test_distillation_process_that_dies_fails_the_run(tmp_path):
    """An engine process that fails (here: prompts longer than its max_model_len) fails the whole
    distillation with an error instead of leaving the others waiting."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    engine_cfg = EngineConfig(
        model=str(model), drafter="none", device="cpu", max_batch_size=2, max_model_len=16
    )
    distill = DistillConfig(
        prompt_files=[str(prompts)], num_prompts=4, max_tokens=8, max_batch_size=2, num_workers=2
    )
    with pytest.raises(RuntimeError, match="process died"):
        self_distill_in_processes(engine_cfg, distill)


def test_cli_distill_only(tmp_path):
    """`eagleserve train-drafter --distill-only` writes a data part (by default beside the output,
    in OUTPUT.data, a trailing slash or not) and trains nothing; here with two engine processes,
    which the CLI module, run with -m, must be able to spawn."""
    model = tiny_target(tmp_path / "target")
    prompts = questions_file(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deployments.cli",
            "train-drafter",
            "--model",
            str(model),
            "-o",
            f"{tmp_path / 'drafter'}/",
            "--prompts",
            str(prompts),
            "--num-prompts",
            "5",
            "--distill-time-limit",
            "60",
            "--distill-workers",
            "2",
            "--device",
            "cpu",
            "--distill-only",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stderr.strip().splitlines()[-1])["num_sequences"] == 5
    assert len(load_data(tmp_path / "drafter.data")) == 5 and not (tmp_path / "drafter").exists()


@pytest.mark.parametrize("largest", [60000, 70000])
def test_token_store_parts_roundtrip(tmp_path, largest):
    """Parts of at most max_part_tokens tokens (a longer sequence alone), stored as uint16 when the
    ids fit, int32 otherwise; read back as the same sequences either way."""
    seqs = [[1, 2, largest], [5], [6, 7, 8, 9, 10], [11, 12]]
    paths = save_parts(tmp_path, TokenStore.from_lists(seqs, [1, 1, 2, 1]), max_part_tokens=4)
    assert [len(TokenStore.load(p)) for p in paths] == [2, 1, 1]
    back = load_data(tmp_path)
    assert (
        back.tokens.dtype == np.int32 and [back.seq(i).tolist() for i in range(len(back))] == seqs
    )
    assert back.prompt_lens.tolist() == [1, 1, 2, 1]


def test_parts_survive_gaps_and_killed_writes(tmp_path, monkeypatch):
    """A new part follows the highest one (a gap left by a deleted part is not filled over an
    existing one), a killed write leaves no part, and a gap or a part cut short is
    an error naming it."""
    for i in range(3):
        save_parts(tmp_path, TokenStore.from_lists([[i, i]], [1]))
    (tmp_path / "part-00001.safetensors").unlink()
    assert [p.name for p in save_parts(tmp_path, TokenStore.from_lists([[9, 9]], [1]))] == [
        "part-00003.safetensors"
    ]
    assert TokenStore.load(tmp_path / "part-00002.safetensors").seq(0).tolist() == [2, 2]
    with pytest.raises(ValueError, match="lacks part-00001.safetensors"):
        load_data(tmp_path)

    def killed(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(train_data, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_parts(tmp_path, TokenStore.from_lists([[8, 8]], [1]))
    assert [p.name for p in data_parts(tmp_path)] == [
        f"part-0000{i}.safetensors" for i in (0, 2, 3)
    ]
    monkeypatch.undo()
    (tmp_path / "part-00001.safetensors").write_bytes(
        (tmp_path / "part-00000.safetensors").read_bytes()[:-4]
    )
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "part-00001.safetensors"))):
        load_data(tmp_path)


def test_distillation_params_do_not_depend_on_the_jobs(tmp_path):
    """A prompt's sampling choice and seed follow from its place in the order: jobs that continue
    each other (skip) give what one job gives."""
    model = tiny_target(tmp_path / "target")
    cfg = DistillConfig(
        prompt_files=[str(questions_file(tmp_path))],
        num_prompts=16,
        num_passes=2,
        max_batch_size=2,
        sampled_fraction=0.5,
        max_prompt_len=128,
    )

    def params(skip):
        return [
            (tuple(ids), p.temperature, p.seed)
            for ids, p in distill_order(cfg, load_tokenizer(model), skip)[1]
        ]

    one_job = params(0)
    assert params(5) == one_job[5:] and params(9) == one_job[9:]
    seeds = [seed for _, _, seed in one_job if seed is not None]
    assert 0 < sum(t == 0 for _, t, _ in one_job[: len(QUESTIONS)]) < len(QUESTIONS) and len(
        set(seeds)
    ) == len(seeds)


def test_batches_pad_to_few_lengths():
    """Every sequence lands in exactly one batch per epoch, each batch keeps to the token budget
    with its rows padded as collate pads them, and the padded lengths come from a short list."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 700, size=2000)
    store = TokenStore.from_lists([[1] * int(n) for n in lens], [1] * len(lens))
    out = batches(store, batch_tokens=4096, max_seq_len=600, seed=0, epoch=0)
    assert sorted(i for b in out for i in b) == list(range(len(lens)))
    shapes = set()
    for b in out:
        ids, lengths, _ = collate(store, b, max_seq_len=600)
        assert ids.shape[1] % PAD_MULTIPLE == 0 and ids.shape[1] >= lengths.max()
        assert ids.numel() <= 4096 or len(b) == 1
        shapes.add(ids.shape[1])
    assert len(shapes) <= -(-600 // PAD_MULTIPLE)


def test_train_step_ignores_padding(tmp_path):
    """The loss and accuracies of a batch are the same padded to its longest row or further."""
    target = load_target(str(tiny_target(tmp_path / "target")), torch.device("cpu"), torch.float32)
    seqs = [
        torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (37, 21, 50)
    ]
    store = TokenStore.from_lists(seqs, [5, 3, 9])
    # the whole vocabulary is draftable, so that the rows past each sequence's end would count if
    # the loss read them (with a smaller draft vocabulary the pad rows' argmax may fall outside it)
    vocab = target.cfg.vocab_size
    cfg = TrainConfig(
        model="unused",
        output="unused",
        data="unused",
        draft_vocab_size=vocab,
        ttt_steps=3,
        device="cpu",
    )
    drafter = init_drafter(cfg, target, store, tmp_path / "drafter")
    draft_to_target = torch.arange(vocab) + drafter.d2t
    with torch.no_grad():
        exact = train_step(
            cfg,
            target,
            drafter,
            draft_to_target,
            collate(store, [0, 1, 2], 64, multiple=1),
            torch.device("cpu"),
            torch.float32,
        )
        padded_batch = collate(store, [0, 1, 2], 64)
        padded = train_step(
            cfg, target, drafter, draft_to_target, padded_batch, torch.device("cpu"), torch.float32
        )
    assert padded_batch[0].shape[1] == 64
    torch.testing.assert_close(padded[0], exact[0])
    torch.testing.assert_close(padded[1], exact[1])


def test_train_step_equals_loss_over_every_row(tmp_path):
    """`train_step` (distributions and heads on the loss rows only) gives what the whole-batch
    definition gives on the same batch: the target's distributions at t+1, the masks, the heads."""
    from speculative.train.target import target_draft_probs, target_features
    from speculative.train.ttt import ttt_forward

    target = load_target(str(tiny_target(tmp_path / "target")), torch.device("cpu"), torch.float32)
    seqs = [
        torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (37, 21, 50)
    ]
    store = TokenStore.from_lists(seqs, [5, 21, 9])  # the second is prompt only
    # the whole vocabulary is draftable: with a few draft tokens, the random target's argmax would
    # almost never be one, and almost no row would count
    vocab = target.cfg.vocab_size
    cfg = TrainConfig(
        model="unused",
        output="unused",
        data="unused",
        draft_vocab_size=vocab,
        ttt_steps=3,
        device="cpu",
        prompt_loss_weight=0.3,
    )
    drafter = init_drafter(cfg, target, store, tmp_path / "drafter")
    draft_to_target = torch.arange(vocab) + drafter.d2t
    batch = collate(store, [0, 1, 2], 64)
    with torch.no_grad():
        loss, accuracy = train_step(
            cfg, target, drafter, draft_to_target, batch, torch.device("cpu"), torch.float32
        )
        ids, lengths, prompt_lens = batch
        hidden, aux = target_features(target, ids)
        probs, is_in_draft = target_draft_probs(target, hidden.flatten(0, 1), draft_to_target)
        logits = [drafter.lm_head(h) for h in ttt_forward(drafter, ids, aux, cfg.ttt_steps)]
        ref_loss, ref_accuracy = old_ttt_loss(
            logits,
            probs.view(*ids.shape, -1),
            is_in_draft.view(ids.shape),
            lengths,
            prompt_lens,
            cfg.step_decay,
            cfg.prompt_loss_weight,
        )
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(accuracy, ref_accuracy)
    assert ref_loss > 1


def tiny_target(path):
    return tiny_llama(path, layers=4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = tiny_target(root / "target")
    prompts = questions_file(root)
    cfg = TrainConfig(
        model=str(model),
        output=str(root / "drafter"),
        data=str(root / "data"),
        distill=DistillConfig(
            prompt_files=[str(prompts)],
            max_tokens=48,
            sampled_fraction=0.0,
            max_batch_size=8,
            max_prompt_len=128,
        ),
        draft_vocab_size=256,
        ttt_steps=3,
        lr=3e-3,
        warmup_steps=5,
        max_steps=80,
        batch_tokens=4096,
        checkpoint_every=20,
        device="cpu",
        time_limit_s=0.001,
        export_dtype="int8",  # the default drafter's storage; later tests load it
    )
    first = train_drafter(cfg)  # stops after one step (time limit) with a checkpoint
    summary = train_drafter(cfg.model_copy(update={"time_limit_s": None}))  # resumes
    return model, root / "drafter", first, summary


def test_training_resumes_and_loss_falls(trained):
    _, drafter, first, summary = trained
    assert first["step"] == 1 and not first["is_complete"]
    assert summary["step"] == 80 and summary["is_complete"]
    history = summary["metrics"]["loss_history"]
    assert history[-1] < 0.8 * history[0], history  # soft CE: the target's entropy stays
    assert summary["metrics"]["accuracy"][0] > 0.8
    assert (drafter / "config.json").is_file() and (drafter / "training_config.json").is_file()


def drafter_tensors(path) -> dict[str, torch.Tensor]:
    return {n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(str(f)).items()}


def test_training_starts_from_a_drafter(trained, tmp_path):
    """init_from copies a drafter's weights: the first step's loss is the trained drafter's, far
    below a fresh one's. With another vocabulary size the vocabulary is the one the data picks, the
    head rows of the tokens both vocabularies hold come from the source, and the others are the
    target's rows mapped as the source's were."""
    model, drafter, _, _ = trained
    base = TrainConfig(
        model=str(model),
        output=str(tmp_path / "fresh"),
        data=str(drafter.parent / "data"),
        draft_vocab_size=256,
        ttt_steps=3,
        max_steps=1,
        batch_tokens=4096,
        device="cpu",
    )
    fresh = train_drafter(base)
    warm = train_drafter(
        base.model_copy(update={"output": str(tmp_path / "warm"), "init_from": str(drafter)})
    )
    assert warm["metrics"]["loss"] < 0.9 * fresh["metrics"]["loss"], (warm, fresh)
    assert warm["metrics"]["accuracy"][0] > fresh["metrics"]["accuracy"][0] + 0.2

    target = load_target(str(model), torch.device("cpu"), torch.float32)
    store = load_data(base.data_dir)
    # a source whose head rows are an affine function of the target's: the rows of tokens it lacks
    # must follow the same function
    source = dequantize_int8(drafter_tensors(drafter))
    source_ids = torch.arange(256) + source["d2t"]
    g = torch.Generator().manual_seed(0)
    hidden = target.lm_head.weight.shape[1]
    M, b = torch.randn(hidden, hidden, generator=g) / hidden**0.5, torch.randn(hidden, generator=g)
    mapped = target.lm_head.weight.detach() @ M + b
    source["lm_head.weight"] = mapped[source_ids]
    shutil.copytree(drafter, tmp_path / "affine")
    for f in (tmp_path / "affine").glob("*.safetensors"):
        f.unlink()
    save_file(source, str(tmp_path / "affine" / "model.safetensors"))
    bigger = base.model_copy(update={"draft_vocab_size": 384})
    init_drafter(bigger, target, store, tmp_path / "picked")
    init_drafter(
        bigger.model_copy(update={"init_from": str(tmp_path / "affine")}),
        target,
        store,
        tmp_path / "grown",
    )
    grown = drafter_tensors(tmp_path / "grown")
    assert torch.equal(grown["t2d"], drafter_tensors(tmp_path / "picked")["t2d"])
    grown_ids = torch.arange(384) + grown["d2t"]
    kept = torch.isin(grown_ids, source_ids)
    assert kept.sum() == 256
    source_row = {int(t): i for i, t in enumerate(source_ids)}
    for row in kept.nonzero().flatten().tolist():
        assert torch.equal(
            grown["lm_head.weight"][row], source["lm_head.weight"][source_row[int(grown_ids[row])]]
        )
    assert torch.allclose(grown["lm_head.weight"][~kept], mapped[grown_ids[~kept]], atol=1e-3)
    for name in source.keys() - {"lm_head.weight", "d2t", "t2d"}:
        assert torch.equal(grown[name], source[name].float()), name


def acceptance(model, drafter) -> float:
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            drafter=str(drafter),
            num_draft_tokens=3,
            max_batch_size=8,
            max_model_len=256,
            device="cpu",
        )
    )
    prompts = [encode_prompt(engine.tokenizer, q) for q in QUESTIONS]
    requests = engine.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
    return sum(r.num_verify_emitted for r in requests) / sum(r.num_verify_steps for r in requests)


def test_trained_drafter_beats_random(trained, tmp_path):
    model, drafter, _, _ = trained
    cfg = drafter_config_for(ModelConfig.from_hf(load_config(model)), draft_vocab_size=256)
    save_drafter(tmp_path / "random", cfg, random_drafter_state(cfg))
    trained_len, random_len = acceptance(model, drafter), acceptance(model, tmp_path / "random")
    assert trained_len > random_len + 0.5, (trained_len, random_len)


def test_checkpoint_survives_a_kill_while_saving(trained, tmp_path, monkeypatch):
    """A run killed while writing a checkpoint resumes from the last whole one and ends with the
    weights of a run straight through; a checkpoint file cut short is an error
    naming the checkpoint."""
    model, drafter, _, _ = trained
    straight = TrainConfig(
        model=str(model),
        output=str(tmp_path / "straight"),
        data=str(drafter.parent / "data"),
        draft_vocab_size=256,
        ttt_steps=2,
        lr=3e-3,
        warmup_steps=3,
        max_steps=6,
        batch_tokens=128,
        checkpoint_every=2,
        device="cpu",
        export_dtype="float32",
    )
    train_drafter(straight)
    killed = straight.model_copy(update={"output": str(tmp_path / "killed")})
    real_save_file, calls = checkpoint.save_file, []

    def dies_in_the_second_save(tensors, path):  # the optimizer file of the step-4 checkpoint
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save_file(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", dies_in_the_second_save)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(killed)
    monkeypatch.undo()
    assert json.loads((tmp_path / "killed.ckpt" / "trainer_state.json").read_text())["step"] == 2
    assert train_drafter(killed)["step"] == 6
    a, b = drafter_tensors(tmp_path / "straight"), drafter_tensors(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    with open(tmp_path / "killed.ckpt" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(
        ValueError, match=re.escape(f"checkpoint {tmp_path / 'killed.ckpt'} is unreadable")
    ):
        train_drafter(killed)


def test_training_target_captures_the_drafters_aux_layers(trained, tmp_path):
    """Trained further from a drafter that names its aux layers, the drafter is fed those layers
    (the ones inference captures for it), on the first run and on resume."""
    model, drafter, _, _ = trained
    dcfg = drafter_config_for(ModelConfig.from_hf(load_config(model)), 256, aux_layer_ids=(0, 1, 3))
    save_drafter(tmp_path / "source", dcfg, random_drafter_state(dcfg))
    cfg = TrainConfig(
        model=str(model),
        output=str(tmp_path / "out"),
        data=str(drafter.parent / "data"),
        init_from=str(tmp_path / "source"),
        draft_vocab_size=256,
        ttt_steps=2,
        max_steps=1,
        batch_tokens=128,
        device="cpu",
    )
    _, _, target, trained_drafter, *_ = trainer._setup(cfg, torch.device("cpu"), torch.float32)
    assert target.aux_layer_ids == trained_drafter.cfg.aux_layer_ids == (0, 1, 3)
    train_drafter(cfg)
    resumed = cfg.model_copy(update={"init_from": None, "max_steps": 2})
    _, _, target, trained_drafter, *_ = trainer._setup(resumed, torch.device("cpu"), torch.float32)
    assert target.aux_layer_ids == trained_drafter.cfg.aux_layer_ids == (0, 1, 3)
    with pytest.raises(ValueError, match="aux layers"):  # a target built with other layers
        init_drafter(
            cfg,
            load_target(str(model), torch.device("cpu"), torch.float32),
            load_data(cfg.data_dir),
            tmp_path / "mismatch",
        )


def test_init_from_refuses_a_checkpoint_to_resume(trained, tmp_path):
    """init_from with a checkpoint of the output present would be ignored (the
    run resumes): refused."""
    model, drafter, _, _ = trained
    cfg = TrainConfig(
        model=str(model),
        output=str(tmp_path / "out"),
        data=str(drafter.parent / "data"),
        draft_vocab_size=256,
        ttt_steps=2,
        max_steps=4,
        batch_tokens=128,
        device="cpu",
        time_limit_s=1e-6,
    )
    assert train_drafter(cfg)["step"] == 1
    with pytest.raises(ValueError, match=re.escape(f"delete {tmp_path / 'out.ckpt'}")):
        train_drafter(cfg.model_copy(update={"init_from": str(drafter), "time_limit_s": None}))


def test_cli_train_drafter_errors(trained, tmp_path, monkeypatch):
    """Bad prompt files, configs, sizes, data parts and --init-from drafters give one-line errors
    naming the problem and the file, and a bad --init-from does so before distilling."""
    from deployments.cli import main

    model, drafter, _, _ = trained
    monkeypatch.chdir(tmp_path)
    files = {
        "noprompt.jsonl": '{"prompt": "hi"}\n{"text": "no prompt"}\n',
        "emptyprompt.jsonl": '{"prompt": ""}\n',
        "empty.jsonl": "",
        "bad.json": '{"output": ',
        "list.json": "[1, 2]",
        "long.json": '{"max_seq_len": 5000}',
        "small.json": '{"distill": {"max_tokens": 4, "max_batch_size": 4}}',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    dcfg = drafter_config_for(ModelConfig.from_hf(load_config(model)), 256)
    save_drafter(
        tmp_path / "nofc",
        dcfg,
        {n: t for n, t in random_drafter_state(dcfg).items() if n != "fc.weight"},
    )
    data = str(drafter.parent / "data")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "part-00000.safetensors").write_bytes(data_parts(data)[0].read_bytes())
    (tmp_path / "cut" / "part-00001.safetensors").write_bytes(data_parts(data)[0].read_bytes()[:-4])
    prompts = str(questions_file(tmp_path))
    cases = [
        (
            ["--prompts", "noprompt.jsonl", "--distill-only"],
            'noprompt.jsonl:2: no non-empty "prompt"',
        ),
        (["--prompts", "emptyprompt.jsonl", "--distill-only"], "emptyprompt.jsonl:1"),
        (["--prompts", "empty.jsonl", "--distill-only"], "empty.jsonl hold no prompts"),
        (
            ["--data", data, "--draft-vocab-size", "60000"],
            "draft_vocab_size 60000 is larger than the vocabulary",
        ),
        (["--config", "bad.json"], "bad.json is not valid JSON"),
        (["--config", "list.json"], "list.json must be a JSON object"),
        (["--config", "long.json", "--data", data], "max_seq_len"),
        (["--data", "cut"], "part-00001.safetensors is unreadable"),
        (
            [
                "--config",
                "small.json",
                "--prompts",
                prompts,
                "--data",
                "fresh",
                "--init-from",
                "nofc",
            ],
            "init_from nofc is not a usable drafter",
        ),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as error:
            main(
                [
                    "train-drafter",
                    "--model",
                    str(model),
                    "-o",
                    "out",
                    "--device",
                    "cpu",
                    "--max-steps",
                    "1",
                    *args,
                ]
            )
        message = str(error.value.code)
        assert re.search(expected, message) and "\n" not in message, (args, message)
    assert not (tmp_path / "fresh").exists()  # the bad --init-from was found before distilling
