"""What steers the target, writing user turns itself, towards each kind of request: short system
prompts (in the rendered prefix only, as Magpie's) and seed phrases that start the user turn.
The "system" kind keeps its system prompt in the conversation: requests with one are a kind of
their own."""

import random
from dataclasses import dataclass

STEERING = {
    "writing": (
        "You are a writing assistant. Users ask you to write stories, poems, emails, essays, "
        "letters, product descriptions and other texts, or to edit theirs.",
        ("Write", "Write a short story", "Compose a poem", "Draft an email", "Rewrite", ""),
    ),
    "chat": (
        "You are a friendly assistant. Users chat with you about their day, hobbies, travel, "
        "food, health, advice and general knowledge.",
        ("Hi!", "What do you think", "Can you recommend", "Tell me about", "Why", ""),
    ),
    "reasoning": (
        "You are a careful assistant. Users ask math word problems, logic puzzles and questions "
        "that need step-by-step reasoning.",
        ("Solve", "If a train", "A store sells", "How many", "Explain step by step", ""),
    ),
    "code": (
        "You are a programming assistant. Users ask you to write, explain, review and fix code "
        "in Python, JavaScript, C++, Rust, SQL, shell and other languages.",
        (
            "Write a Python function",
            "How do I",
            "Fix this code:",
            "Explain this code:",
            "In SQL,",
            "",
        ),
    ),
    "extraction": (
        "You are a data assistant. Users give you text and ask you to extract fields, classify "
        "it, summarise it or turn it into JSON, tables or lists.",
        (
            "Extract",
            "Convert the following to JSON:",
            "Summarize",
            "Classify",
            "From this text,",
            "",
        ),
    ),
    "system": (
        None,  # the conversation's own system prompt steers
        ("", "Please", "I need", "Can you"),
    ),
}

SYSTEM_PROMPTS = (
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a helpful customer support agent for an online shop.",
    "You are a patient tutor who explains things to a twelve-year-old.",
    "You are a senior software engineer reviewing code.",
    "Always answer in valid JSON.",
    "You are a travel guide who knows every city in Europe.",
    "You are a chef. Give recipes with exact quantities.",
    "Reply in a formal tone and use bullet points.",
)


@dataclass(frozen=True)
class RequestSpec:
    kind: str
    steering_system: str | None  # in the prefix the user turn is written after, not kept
    system: str | None  # the conversation's own system prompt, kept
    seed_phrase: str  # the user turn's start


def draw_spec(rng: random.Random, kinds: list[str]) -> RequestSpec:
    kind = rng.choice(kinds)
    steering, seeds = STEERING[kind]
    system = rng.choice(SYSTEM_PROMPTS) if kind == "system" else None
    return RequestSpec(kind, steering, system, rng.choice(seeds))
