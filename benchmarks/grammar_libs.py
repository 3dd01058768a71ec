"""xgrammar against llguidance on SmolLM2's tokenizer (49152 tokens), on the host CPU: the time to
compile a JSON schema (a fresh compiler each time, so no cache hits) and the time to fill one
token's bitmask while walking a valid output token by token. Writes grammar_libs_cpu.json.

    python benchmarks/grammar_libs.py [--out benchmarks/grammar_libs_cpu.json]
"""

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@math.org",
    "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "W1"},
    "role": "admin",
}


def bench_xgrammar(tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compile_s = []
    for _ in range(repeats):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
        compile_s.append(time.perf_counter() - start)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    mask_s = []
    for t in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_s.append(time.perf_counter() - start)
        assert matcher.accept_token(t), t
    return _summary(compile_s, mask_s)


def bench_llguidance(tokenizer, vocab_size: int, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compile_s = []
    for _ in range(repeats):  # llguidance compiles lazily: the matcher's creation + first mask
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.compute_bitmask()
        compile_s.append(time.perf_counter() - start)
    matcher = llguidance.LLMatcher(lltok, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    mask_s = []
    for t in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        mask_s.append(time.perf_counter() - start)
        assert matcher.consume_token(t), matcher.get_error()
    return _summary(compile_s, mask_s)


def _summary(compile_s: list[float], mask_s: list[float]) -> dict:
    return {
        "compile_ms_median": 1e3 * statistics.median(compile_s),
        "compile_ms_min": 1e3 * min(compile_s),
        "mask_us_median": 1e6 * statistics.median(mask_s),
        "mask_us_p90": 1e6 * sorted(mask_s)[int(0.9 * len(mask_s))],
        "mask_us_max": 1e6 * max(mask_s),
        "num_tokens": len(mask_s),
    }


def main() -> None:
    from workers.models import load_config
    from workers.models.loader import load_tokenizer, resolve_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/grammar_libs_cpu.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model_dir = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(model_dir)
    vocab_size = load_config(model_dir)["vocab_size"]
    tokens = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    results = {
        "vocab_size": vocab_size,
        "xgrammar": bench_xgrammar(tokenizer, vocab_size, tokens, args.repeats),
        "llguidance": bench_llguidance(tokenizer, vocab_size, tokens, args.repeats),
    }
    print(f"{'library':12} {'compile ms':>11} {'mask us p50':>12} {'p90':>8} {'max':>8}")
    for name in ("xgrammar", "llguidance"):
        r = results[name]
        print(
            f"{name:12} {r['compile_ms_median']:11.1f} {r['mask_us_median']:12.1f} "
            f"{r['mask_us_p90']:8.1f} {r['mask_us_max']:8.1f}"
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
