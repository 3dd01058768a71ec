"""`eagleserve`: generate offline, serve over HTTP, train drafters, benchmark, load-test a server
(one function per subcommand; their parsers are in cli_args.py)."""

import json
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from deployments.cli_args import build_parser
from deployments.cli_bench import cmd_bench, cmd_loadtest
from deployments.cli_serve import cmd_serve
from deployments.engine_flags import ENGINE_FLAGS
from deployments.local_ray import local_cpus, local_ray_env


def _engine_config(args):
    from speculative.config import EngineConfig

    flags = {name: getattr(args, name) for name in ENGINE_FLAGS}
    return EngineConfig(**flags, overlap=not args.no_overlap)


def _read_jsonl(path: Path) -> list[dict]:
    from speculative.jsonl import read_rows

    rows = []
    try:
        for where, row in read_rows(path):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SystemExit(f"error: {where}: each row needs a string field 'prompt'")
            if type(row.get("priority", 0)) is not int:  # JSON true is no priority
                raise SystemExit(f"error: {where}: 'priority' must be an integer")
            rows.append(row)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return rows


def cmd_generate(args) -> None:
    from speculative.config import SamplingParams
    from speculative.engine.llm_engine import encode_prompt
    from speculative.engine.request import RequestError
    from workers.models.loader import load_tokenizer, resolve_model

    if not args.input.is_file():
        raise SystemExit(f"error: input file {args.input} does not exist")
    rows = _read_jsonl(args.input)
    if not rows:
        raise SystemExit(f"error: {args.input}: no prompts")
    sampling = dict(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    params = [SamplingParams(**sampling, priority=row.get("priority", 0)) for row in rows]
    cfg = _engine_config(args)
    tokenizer = load_tokenizer(resolve_model(cfg.model))
    prompts = [encode_prompt(tokenizer, row["prompt"], args.raw) for row in rows]
    try:
        results = run_to_completion(cfg, prompts, params)
    except RequestError as e:
        raise SystemExit(f"error: {e}") from None
    with open(args.output, "w") as f:
        for i, (row, r) in enumerate(zip(rows, results)):
            f.write(
                json.dumps(
                    {
                        "id": row.get("id", i),
                        "text": tokenizer.decode(r["token_ids"], skip_special_tokens=True),
                        "token_ids": r["token_ids"],
                        "num_tokens": len(r["token_ids"]),
                        "acceptance_length": round(r["acceptance_length"], 4),
                        "finish_reason": r["finish_reason"],
                    }
                )
                + "\n"
            )
    mean = sum(r["acceptance_length"] for r in results) / max(len(results), 1)
    print(
        f"wrote {len(results)} rows to {args.output} (mean acceptance length {mean:.2f})",
        file=sys.stderr,
    )


def run_to_completion(cfg, prompts: list[list[int]], params: list) -> list[dict]:
    """TP=1: the single-process engine. TP>1: worker actors on a local Ray (or RAY_ADDRESS) driven
    by the coordinator actor."""
    if cfg.tp == 1:
        from speculative.engine.llm_engine import LLMEngine

        requests = LLMEngine(cfg).generate(prompts, params)
        return [
            {
                "token_ids": r.output_ids,
                "finish_reason": r.finish_reason,
                "acceptance_length": r.acceptance_length,
            }
            for r in requests
        ]
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        local_ray_env()
    import ray

    from speculative.drafter_format import drafter_dir
    from speculative.engine.coordinator import CoordinatorActor
    from speculative.engine.executor import check_tp_size

    check_tp_size(cfg)  # what fails here would fail in every worker, with Ray's tracebacks
    if cfg.drafter not in ("none", "default", "ngram"):
        drafter_dir(cfg.drafter)
    num_cpus = None if address or cfg.device == "cuda" else local_cpus(cfg.tp)
    ray.init(
        address=address,
        num_cpus=num_cpus,
        include_dashboard=None if address else False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        coordinator = CoordinatorActor.remote(cfg)
        try:
            return ray.get(coordinator.generate.remote(prompts, params))
        except ray.exceptions.RayTaskError as e:
            raise (
                e.cause or e
            ) from None  # the error itself (a bad request, say), not Ray's traceback
        finally:
            ray.get(coordinator.shutdown.remote())
    finally:
        ray.shutdown()


def cmd_train_drafter(args) -> None:
    from speculative.train.config import TrainConfig
    from speculative.train.pipeline import train_drafter

    fields = {}
    if args.config:
        try:
            fields = json.loads(args.config.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config {args.config} is not valid JSON: {e}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("distill", {}), dict):
            raise ValueError(
                f"config {args.config} must be a JSON object of TrainConfig fields "
                "(distill: an object)"
            )
    fields.update(
        {
            k: v
            for k, v in {
                "model": args.model,
                "output": args.output,
                "data": args.data,
                "corpora": args.corpora,
                "max_steps": args.max_steps,
                "draft_vocab_size": args.draft_vocab_size,
                "ttt_steps": args.ttt_steps,
                "lr": args.lr,
                "num_epochs": args.epochs,
                "checkpoint_every": args.checkpoint_every,
                "eval_prompt_files": args.eval_prompts,
                "time_limit_s": args.time_limit,
                "max_steps_this_run": args.steps_this_run,
                "handover": args.handover,
                "handover_dtype": args.handover_dtype,
                "handover_optimizer": args.handover_optimizer,
                "init_from": args.init_from,
                "device": args.device,
            }.items()
            if v is not None
        }
    )
    distill = {
        k: v
        for k, v in {
            "prompt_files": args.prompts,
            "num_prompts": args.num_prompts,
            "time_limit_s": args.distill_time_limit,
            "skip_prompts": args.distill_skip,
            "num_workers": args.distill_workers,
        }.items()
        if v is not None
    }
    if distill:
        fields["distill"] = {**fields.get("distill", {}), **distill}
    _synthesis_fields(args, fields)
    summary = train_drafter(TrainConfig(**fields), distill_only=args.distill_only)
    print(json.dumps(summary), file=sys.stderr)


def _synthesis_fields(args, fields: dict) -> None:
    """--synthesize's settings, decontaminated against every benchmark set shipped here; the
    acceptance at the end on the held-out sets unless --eval-prompts says otherwise."""
    from deployments.prompt_sets import benchmark_files, heldout_files

    synth = {
        k: v
        for k, v in {
            "num_conversations": args.synthesize,
            "time_limit_s": args.synthesize_time_limit,
            "kinds": args.kinds,
        }.items()
        if v is not None
    }
    if not synth and fields.get("synthesize") is None:
        return
    synth = {**(fields.get("synthesize") or {}), **synth}
    synth.setdefault("decontaminate_files", [str(f) for f in benchmark_files()])
    fields["synthesize"] = synth
    fields.setdefault("eval_prompt_files", [str(f) for f in heldout_files()])


COMMANDS = {
    "generate": cmd_generate,
    "train-drafter": cmd_train_drafter,
    "serve": cmd_serve,
    "bench": cmd_bench,
    "loadtest": cmd_loadtest,
}


def main(argv=None) -> None:
    args = build_parser(__doc__).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        COMMANDS[args.command](args)
    except ValidationError as e:
        where = ".".join(str(p) for p in e.errors()[0]["loc"]) or "engine config"
        raise SystemExit(f"error: invalid setting: {where}: {e.errors()[0]['msg']}") from None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
