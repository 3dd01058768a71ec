"""The prompt sets shipped in deployments/data (licences and provenance in data/PROVENANCE.md):
GSM8K test questions, the EAGLE benchmark question sets and the held-out writing and code sets,
read as the benchmarks, the load test and the training decontamination read them."""

from pathlib import Path

from speculative.jsonl import read_rows

DATA = Path(__file__).resolve().parent / "data"  # shipped prompts: data/PROVENANCE.md
GSM8K_TEST = DATA / "gsm8k" / "test.jsonl.gz"
EAGLE_SETS = ("gsm8k", "alpaca", "sum", "qa")


def eagle_set(name: str) -> Path:
    """One of the EAGLE benchmark question sets (EAGLE_SETS), MT-Bench rows."""
    return DATA / "eagle_bench" / f"{name}.jsonl.gz"


HELDOUT_SETS = ("writing", "code")  # data/heldout: in no training set (data/PROVENANCE.md)


def heldout_set(name: str) -> Path:
    return DATA / "heldout" / f"{name}.jsonl.gz"


def heldout_files() -> list[Path]:
    return [heldout_set(name) for name in HELDOUT_SETS]


def benchmark_files() -> list[Path]:
    """Every prompt set shipped here: what training data is decontaminated against."""
    return [GSM8K_TEST] + [eagle_set(name) for name in EAGLE_SETS] + heldout_files()


def load_prompts(path: str | None, num: int) -> list[str]:
    """The first `num` prompts (0: all) of the shipped GSM8K test questions by default, else of any
    JSONL(.gz) whose rows hold prompt, question or turns[0]."""
    path = Path(path) if path else GSM8K_TEST
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} not found")
    prompts = []
    for where, row in read_rows(path):
        try:
            prompt = (
                row["prompt"]
                if "prompt" in row
                else row["question"]
                if "question" in row
                else row["turns"][0]
            )
        except (TypeError, KeyError, IndexError):
            prompt = None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"{where}: expected a JSON object with a non-empty prompt, question or turns[0]"
            )
        prompts.append(prompt)
        if len(prompts) == num:
            break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
