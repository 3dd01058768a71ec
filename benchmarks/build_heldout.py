"""Builds the held-out evaluation sets in deployments/data/heldout/ (see PROVENANCE.md there):
prompts that no training set holds, for acceptance on chat/writing and on code.

    apt-get download fortunes-min && dpkg-deb -x fortunes-min_*.deb /tmp/fortunes
    python benchmarks/build_heldout.py --fortunes /tmp/fortunes/usr/share/games/fortunes \
        --train-prompts DIR   # the training prompt files (*.jsonl.gz) the drafters learned from

writing: Debian's fortunes-min quotations (literature, fortunes) inside writing and chat
requests, one template each in turn. code: docstrings of the running CPython's pure-Python
standard library, as "write this function" requests. Every prompt that shares a 13-word run with
a training prompt or a shipped benchmark prompt is left out (counted in the output).
"""

import argparse
import gzip
import importlib
import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.prompt_sets import DATA, EAGLE_SETS, GSM8K_TEST, eagle_set  # noqa: E402
from speculative.train.decontaminate import Decontaminator, read_benchmark_prompts  # noqa: E402

WRITING_TEMPLATES = (
    "Write a short story that begins with this line:\n\n{q}",
    "Write a poem inspired by this quotation:\n\n{q}",
    "What does this quotation mean? Explain it to me in a few paragraphs.\n\n{q}",
    'A friend texted me this: "{q}" How should I reply? Give me three options.',
    "Write a short persuasive essay agreeing or disagreeing with this:\n\n{q}",
    "Rewrite this in modern, plain English and then in the style of a pirate:\n\n{q}",
)
CODE_MODULES = (
    "textwrap", "string", "shlex", "fnmatch", "difflib", "bisect", "heapq", "statistics",
    "colorsys", "calendar", "html", "base64", "posixpath", "urllib.parse", "functools",
    "ipaddress", "fractions", "glob", "email.utils", "random", "secrets", "quopri", "uu",
    "keyword", "numbers", "operator", "copy", "pprint", "reprlib", "graphlib", "netrc",
    "mimetypes", "filecmp", "gettext", "locale", "tokenize", "json.encoder", "csv",
)  # fmt: skip
MAX_CODE_DOC_CHARS = 700


def quotations(directory: Path, names=("literature", "fortunes"), per_file=120) -> list[str]:
    """The first `per_file` quotations of 20 to 600 characters of each file."""
    out = []
    for name in names:
        texts = (directory / name).read_text(encoding="latin-1").split("\n%\n")
        texts = [t.strip().replace("\t", " ") for t in texts]
        out += [t for t in texts if 20 <= len(t) <= 600][:per_file]
    return out


def writing_prompts(directory: Path) -> list[dict]:
    return [
        {
            "id": f"writing-{i:03d}",
            "source": "fortunes-min",
            "prompt": WRITING_TEMPLATES[i % len(WRITING_TEMPLATES)].format(q=q),
        }
        for i, q in enumerate(quotations(directory))
    ]


def code_prompts() -> list[dict]:
    rows = []
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj):
                continue
            if obj.__module__ != module.__name__ or not obj.__doc__:
                continue
            doc = inspect.cleandoc(obj.__doc__)
            if len(doc) < 60 or len(doc) > MAX_CODE_DOC_CHARS:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            prompt = (
                f"Write a Python function `{name}{signature}` that does the following, without "
                f"importing `{module_name}`:\n\n{doc}"
            )
            rows.append({"source": f"cpython:{module_name}.{name}", "prompt": prompt})
    return [{"id": f"code-{i:03d}", **r} for i, r in enumerate(rows)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fortunes", type=Path, required=True, help="fortunes-min's data folder")
    p.add_argument("--train-prompts", type=Path, help="folder of training prompt files")
    p.add_argument("--output", type=Path, default=DATA / "heldout")
    args = p.parse_args(argv)
    others = [str(GSM8K_TEST)] + [str(eagle_set(n)) for n in EAGLE_SETS]
    if args.train_prompts:
        others += [str(f) for f in sorted(args.train_prompts.glob("*.jsonl*"))]
    contamination = Decontaminator(read_benchmark_prompts(others))
    args.output.mkdir(parents=True, exist_ok=True)
    for name, rows in (("writing", writing_prompts(args.fortunes)), ("code", code_prompts())):
        kept = [r for r in rows if not contamination.is_contaminated(r["prompt"])]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
        with gzip.GzipFile(args.output / f"{name}.jsonl.gz", "wb", mtime=0) as f:
            f.write(text.encode())
        print(f"{name}: {len(kept)} prompts ({len(rows) - len(kept)} left out as contaminated)")


if __name__ == "__main__":
    main()
