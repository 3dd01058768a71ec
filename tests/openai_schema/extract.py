"""Writes components.json: the response schemas the API tests validate against, with every schema
they reference, cut out of OpenAI's published OpenAPI document. Run it on a newer openapi.json
(github.com/openai/openai-openapi) to refresh them: python extract.py OPENAPI_JSON COMMIT"""

import json
import sys
from pathlib import Path

SOURCE = "https://github.com/openai/openai-openapi/blob/{commit}/openapi.json"
ROOTS = [
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
]


def refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"].rsplit("/", 1)[-1]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def main(path: str, commit: str) -> None:
    document = json.loads(Path(path).read_text())
    schemas, todo, kept = document["components"]["schemas"], list(ROOTS), {}
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = schemas[name]
            todo += refs(schemas[name])
    out = {
        "source": SOURCE.format(commit=commit),
        "openapi": document["openapi"],
        "version": document["info"]["version"],
        "components": {"schemas": dict(sorted(kept.items()))},
    }
    Path(__file__).with_name("components.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
