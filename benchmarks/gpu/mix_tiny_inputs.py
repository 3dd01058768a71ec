"""The inputs of `TINY=1 bash benchmarks/gpu/mix_slice_job.sh` (its CPU dry run), in WORK: a tiny
random target with SmolLM2's tokenizer, a random drafter as the shipped one, a synthetic corpus of
a few conversations and a distilled part, as .device/ would hold them, and the mix config with
tiny sizes.

    python3 benchmarks/gpu/mix_tiny_inputs.py /tmp/mix-tiny
"""

import gzip
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from tiny_models import tiny_llama  # noqa: E402

from speculative.drafter_format import (  # noqa: E402
    drafter_config_for,
    random_drafter_state,
    save_drafter,
)
from speculative.train.data import TokenStore, save_parts  # noqa: E402
from workers.models import ModelConfig  # noqa: E402


def main(work: Path) -> None:
    target = tiny_llama(work / "target", layers=4)
    cfg = drafter_config_for(ModelConfig.from_dir(target), draft_vocab_size=256)
    save_drafter(work / "baseline", cfg, random_drafter_state(cfg))
    (work / "device" / "mix").mkdir(parents=True)
    chats = [
        [{"role": "user", "content": f"What is {i} plus {i}?"},
         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}] for i in range(6)
    ]  # fmt: skip
    rows = [{"id": f"t{i}", "kind": "qa", "messages": m} for i, m in enumerate(chats)]
    with gzip.open(work / "device" / "mix" / "synthetic.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 49152, 40).tolist() for _ in range(6)]
    save_parts(work / "device" / "distilled", TokenStore.from_lists(seqs, [10] * 6))
    mix = json.loads((ROOT / "speculative/train/smollm2_mix.json").read_text())
    mix |= {"output": str(work / "drafter"), "data": str(work / "synthetic"),
            "handover": str(work / "handover"), "draft_vocab_size": 256, "ttt_steps": 2,
            "batch_tokens": 1024, "max_steps": 4, "export_shard_mb": 1,
            "synthesize": {"num_conversations": 6, "max_model_len": 192}}  # fmt: skip
    (work / "mix.json").write_text(json.dumps(mix, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
