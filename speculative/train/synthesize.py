"""A training corpus with no dataset, Magpie-style: the target writes the user turns itself (its
chat template rendered up to a user turn's opening, steered by kind), duplicates and benchmark
prompts are dropped, and the target answers through our engine, greedy and sampled, sometimes
over a follow-up turn written the same way. Rows go to a JSONL file as they are made; a rerun
continues the file."""

import json
import random
import time
from pathlib import Path

from tqdm import tqdm

from speculative.config import SamplingParams
from speculative.train.decontaminate import Decontaminator, DuplicateFilter, read_benchmark_prompts
from speculative.train.distill import generate_in_waves
from speculative.train.request_kinds import RequestSpec, draw_spec
from speculative.train.synth_config import SynthConfig

USER_TURN_MARK = "<<EAGLESERVE-USER-TURN>>"


def user_turn_prefix(tokenizer, messages: list[dict]) -> str:
    """The chat template rendered for `messages` and up to the opening of the next user turn."""
    text = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": USER_TURN_MARK}],
        tokenize=False,
        add_generation_prompt=False,
    )
    if USER_TURN_MARK not in text:
        raise ValueError("the chat template does not render a user turn's content as given")
    return text[: text.index(USER_TURN_MARK)]


def read_corpus(path: Path) -> list[dict]:
    """The rows of a corpus file; a last line cut short (a killed write) is removed."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines) - 1:
                raise ValueError(f"{path}:{number + 1}: not valid JSON") from None
            path.write_text("".join(x + "\n" for x in lines[:-1]))
    return rows


class Synthesizer:
    """Writes conversations with one engine (drafter "none" or any: output is the target's)."""

    def __init__(self, engine, cfg: SynthConfig):
        self.engine, self.cfg, self.tokenizer = engine, cfg, engine.tokenizer
        self.eos = self.tokenizer.eos_token_id
        self.duplicates = DuplicateFilter(cfg.near_duplicate_threshold, cfg.seed)
        self.contamination = Decontaminator(read_benchmark_prompts(cfg.decontaminate_files))
        self.num_dropped = {"duplicate": 0, "contaminated": 0, "short": 0, "too_long": 0}

    def is_kept(self, text: str) -> bool:
        """Counts why a user turn is dropped; a kept one is remembered for the duplicate check."""
        if len(text.split()) < self.cfg.min_user_words:
            reason = "short"
        elif self.contamination.is_contaminated(text):
            reason = "contaminated"
        elif not self.duplicates.add(text):
            reason = "duplicate"
        else:
            return True
        self.num_dropped[reason] += 1
        return False

    def run(self, path: Path) -> dict:
        """Adds rows to `path` until it holds `num_conversations` or the time limit stops it."""
        cfg, rows = self.cfg, read_corpus(path)
        for row in rows:  # a continued run drops what earlier runs kept
            for m in row["messages"]:
                if m["role"] == "user":
                    self.duplicates.add(m["content"])
        start, num_rounds, num_rows = time.perf_counter(), 0, len(rows)
        bar = tqdm(total=cfg.num_conversations, initial=num_rows, desc="synthesizing", unit="conv")
        with path.open("a") as out:
            while num_rows < cfg.num_conversations:
                elapsed = time.perf_counter() - start
                if num_rounds and cfg.time_limit_s and elapsed > cfg.time_limit_s:
                    break  # after a round at least: every run makes progress
                # a str seed hashes the same in every process; the file's length continues it
                rng = random.Random(f"{cfg.seed}/{num_rows}/{num_rounds}")
                wanted = cfg.num_conversations - num_rows
                for conv in self.round(rng, min(wanted + wanted // 4 + 4, 4 * cfg.max_batch_size)):
                    if num_rows == cfg.num_conversations:
                        break
                    out.write(json.dumps({"id": f"synth-{num_rows:06d}", **conv}) + "\n")
                    num_rows += 1
                    bar.update()
                out.flush()
                num_rounds += 1
                if num_rounds > 50 and num_rows == len(rows):
                    raise RuntimeError(f"50 rounds kept no conversation: {self.num_dropped}")
        bar.close()
        return {
            "num_conversations": num_rows,
            "is_complete": num_rows >= cfg.num_conversations,
            "dropped_user_turns": dict(self.num_dropped),
            "seconds": round(time.perf_counter() - start, 1),
        }

    def round(self, rng: random.Random, size: int) -> list[dict]:
        """`size` first user turns written, filtered and answered; some go on a turn more."""
        specs = [draw_spec(rng, self.cfg.kinds) for _ in range(size)]
        histories = [[{"role": "system", "content": s.system}] if s.system else [] for s in specs]
        users = self.write_user_turns(histories, specs, rng)
        convs = [
            {"kind": s.kind, "messages": h + [{"role": "user", "content": u}]}
            for s, h, u in zip(specs, histories, users)
            if u is not None and self.is_kept(u)
        ]
        for conv in convs:
            conv["sampled"] = rng.random() < self.cfg.sampled_fraction
        convs = self.answer(convs, rng)
        # an answer cut by max_tokens may go on too: the follow-up is written after it as cut
        going_on = [c for c in convs if rng.random() < self.cfg.multi_turn_fraction]
        follow_ups = self.write_user_turns(
            [c["messages"] for c in going_on], [None] * len(going_on), rng
        )
        more = []
        for conv, text in zip(going_on, follow_ups):
            if text is not None and self.is_kept(text):
                conv["messages"].append({"role": "user", "content": text})
                more.append(conv)
        self.answer(more, rng)  # a follow-up left unanswered is taken back
        return convs

    def write_user_turns(
        self, histories: list[list[dict]], specs: list[RequestSpec | None], rng: random.Random
    ) -> list[str | None]:
        """The target's user turn after each history (None where the prompt is too long)."""
        cfg, seeds, jobs = self.cfg, [], []
        for i, (history, spec) in enumerate(zip(histories, specs)):
            # a kept system prompt (the history's) steers by itself
            is_steered = spec is not None and spec.steering_system and not history
            steering = [{"role": "system", "content": spec.steering_system}] if is_steered else []
            seed = spec.seed_phrase if spec else ""
            prefix = user_turn_prefix(self.tokenizer, steering + history) + seed
            ids = self.tokenizer.encode(prefix, add_special_tokens=False)
            seeds.append(seed)
            if len(ids) + cfg.max_user_tokens < cfg.max_model_len:
                params = SamplingParams(
                    temperature=cfg.user_temperature,
                    top_p=cfg.user_top_p,
                    max_tokens=cfg.max_user_tokens,
                    seed=rng.randrange(2**31),
                )
                jobs.append((i, ids, params))
        texts: list[str | None] = [None] * len(histories)
        for i, _, output in generate_in_waves(self.engine, iter(jobs)):
            if output and output[-1] == self.eos:  # a turn cut by max_tokens is kept as it is
                output = output[:-1]
            texts[i] = (seeds[i] + self.tokenizer.decode(output, skip_special_tokens=True)).strip()
        return texts

    def answer(self, convs: list[dict], rng: random.Random) -> list[dict]:
        """Appends the target's answer to each conversation (greedy or sampled, by its flag);
        -> those answered. The last user turn of one whose prompt leaves no room is removed."""
        from speculative.engine.llm_engine import encode_chats

        cfg, jobs = self.cfg, []
        prompts = encode_chats(self.tokenizer, [c["messages"] for c in convs]) if convs else []
        for i, (conv, ids) in enumerate(zip(convs, prompts)):
            params = SamplingParams(
                temperature=cfg.temperature if conv["sampled"] else 0.0,
                max_tokens=min(cfg.max_tokens, max(cfg.max_model_len - len(ids) - 1, 1)),
                seed=rng.randrange(2**31) if conv["sampled"] else None,
            )
            if len(ids) < cfg.max_model_len - 1:
                jobs.append((i, ids, params))
            else:
                self.num_dropped["too_long"] += 1
        answers = {i: output for i, _, output in generate_in_waves(self.engine, iter(jobs))}
        for i, conv in enumerate(convs):
            if i not in answers:
                conv["messages"].pop()
                continue
            output = answers[i]
            conv["truncated"] = not output or output[-1] != self.eos
            text = self.tokenizer.decode(
                output[:-1] if not conv["truncated"] else output, skip_special_tokens=True
            )
            conv["messages"].append({"role": "assistant", "content": text})
        return [c for i, c in enumerate(convs) if i in answers]
