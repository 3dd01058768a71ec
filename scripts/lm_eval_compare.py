"""lm-evaluation-harness against a running eagleserve server (its `local-completions` model, at its
default settings) and against Hugging Face transformers (`hf`) on the same converted model, on a
local task file: multiple-choice GSM8K (loglikelihoods) and greedy GSM8K answers (generate_until).
Prints the accuracies and the per-sample differences, and writes them as JSON.

Not in the test suite: lm-eval is heavy (pip install lm-eval). Start a server first, e.g.
    eagleserve serve --port 8000        # smollm2-135m with its drafter
    python scripts/lm_eval_compare.py --base-url http://127.0.0.1:8000 --model smollm2-135m
"""

import argparse
import json
import random
import tempfile
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
MC_TASK = """task: gsm8k_mc_local
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_TASK = """task: gsm8k_gen_local
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(gsm8k: Path, num_mc: int, num_gen: int, max_gen_toks: int, out: Path) -> Path:
    """The local task files and their data: each GSM8K question with its final answer and three
    wrong numbers as choices (in a seeded order), and the first questions for greedy answers."""
    rows = [json.loads(line) for line in gsm8k.read_text().splitlines()[: max(num_mc, num_gen)]]
    rng = random.Random(0)
    mc = []
    for row in rows[:num_mc]:
        answer = int(row["answer"].split("####")[-1].strip().replace(",", ""))
        choices = [answer, answer + rng.randint(1, 9), answer * 2 + 1, max(0, answer - 3) + 10]
        choices = list(dict.fromkeys(f" {c}" for c in choices))
        rng.shuffle(choices)
        mc.append(
            {"question": row["question"], "choices": choices, "label": choices.index(f" {answer}")}
        )
    gen = [
        {"question": r["question"], "answer": " " + r["answer"].split("####")[-1].strip()}
        for r in rows[:num_gen]
    ]
    for name, data in (("mc", mc), ("gen", gen)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in data))
    (out / "mc.yaml").write_text(MC_TASK.format(data=out / "mc.jsonl"))
    (out / "gen.yaml").write_text(
        GEN_TASK.format(data=out / "gen.jsonl", max_gen_toks=max_gen_toks)
    )
    return out


def evaluate(model: str, model_args: dict, tasks: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["gsm8k_mc_local", "gsm8k_gen_local"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=1,
    )


def per_sample(results: dict) -> dict:
    """Per task: doc id -> what the model returned (loglikelihoods and is-greedy per choice, or
    the generation)."""
    samples = {}
    for task, rows in results["samples"].items():
        samples[task] = {row["doc_id"]: row["resps"] for row in rows}
    return samples


def compare(served: dict, hf: dict) -> dict:
    ours, theirs = per_sample(served), per_sample(hf)
    mc_ours, mc_theirs = ours["gsm8k_mc_local"], theirs["gsm8k_mc_local"]
    diffs = [
        abs(float(a[0][0]) - float(b[0][0]))
        for doc in mc_theirs
        for a, b in zip(mc_ours[doc], mc_theirs[doc])
    ]
    greedy_flags = sum(
        a[0][1] != b[0][1] for doc in mc_theirs for a, b in zip(mc_ours[doc], mc_theirs[doc])
    )
    gen_ours, gen_theirs = ours["gsm8k_gen_local"], theirs["gsm8k_gen_local"]
    same = sum(gen_ours[d][0][0] == gen_theirs[d][0][0] for d in gen_theirs)
    acc = lambda r, t, m: r["results"][t][m]  # noqa: E731
    return {
        "mc_accuracy": {
            "served": acc(served, "gsm8k_mc_local", "acc,none"),
            "hf": acc(hf, "gsm8k_mc_local", "acc,none"),
        },
        "gen_exact_match": {
            "served": acc(served, "gsm8k_gen_local", "exact_match,none"),
            "hf": acc(hf, "gsm8k_gen_local", "exact_match,none"),
        },
        "loglikelihoods": len(diffs),
        "max_abs_loglikelihood_diff": max(diffs),
        "loglikelihoods_over_1e-4": sum(d > 1e-4 for d in diffs),
        "is_greedy_disagreements": greedy_flags,
        "generations": len(gen_theirs),
        "identical_generations": same,
        "differing_generations": {
            d: {"served": gen_ours[d][0][0], "hf": gen_theirs[d][0][0]}
            for d in gen_theirs
            if gen_ours[d][0][0] != gen_theirs[d][0][0]
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--base-url", required=True, help="the running server, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--model", default="smollm2-135m", help="the served model (name or directory)")
    p.add_argument("--served-name", help="its name on the server (default: --model)")
    p.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K test.jsonl")
    p.add_argument("--num-mc", type=int, default=60)
    p.add_argument("--num-gen", type=int, default=20)
    p.add_argument("--max-gen-toks", type=int, default=64)
    p.add_argument("--output", type=Path, default=Path("lm_eval_compare.json"))
    args = p.parse_args()

    from workers.models.loader import resolve_model

    model_dir = str(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(args.gsm8k, args.num_mc, args.num_gen, args.max_gen_toks, Path(tmp))
        # local-completions at its defaults: token-id prompts, batch 1, one request at a time
        served = evaluate(
            "local-completions",
            {
                "model": args.served_name or args.model,
                "base_url": f"{args.base_url.rstrip('/')}/v1/completions",
                "tokenizer": model_dir,
            },
            tasks,
        )
        hf = evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}, tasks)
    report = compare(served, hf)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'':24} {'served':>10} {'hf':>10}")
    for name in ("mc_accuracy", "gen_exact_match"):
        print(f"{name:24} {report[name]['served']:>10.4f} {report[name]['hf']:>10.4f}")
    print(
        f"{report['loglikelihoods']} loglikelihoods: max |diff| "
        f"{report['max_abs_loglikelihood_diff']:.2e}, {report['loglikelihoods_over_1e-4']} over "
        f"1e-4, is_greedy differs in {report['is_greedy_disagreements']}; "
        f"{report['identical_generations']}/{report['generations']} generations identical"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
