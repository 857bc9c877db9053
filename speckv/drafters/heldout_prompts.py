"""The held-out speculation prompt set: prompts that neither the head nor the policy saw.

Owns `HELDOUT_SET`, the set `speckv bench spec-decode` measures by default (and so the figure
in `benchmark.json` that the defaults and the banner rest on), and its four families:

- `chat`:   open requests in templates and on topics that no prompt of `prompts.py` uses
            (neither the head's training prompts nor the held-out prompts its training
            reported on, which is also where the adaptive policy was tuned);
- `code`:   programming tasks in other languages and phrasings (Rust, SQL, shell, C, Go ...);
- `list`:   list requests in other phrasings and on other subjects;
- `random`: random token ids (no chat template), as `vllm bench serve`'s random dataset: the
            case where no drafter can guess anything.

Every list is fixed here and every draw is seeded, so the set is the same on every machine.
`tests/drafters/test_heldout_prompts.py` checks that no held-out prompt shares a four-word
sequence with any prompt in `prompts.py`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

HELDOUT_SET = "heldout-v1"  # named in the bench output and benchmark.json
FAMILIES: tuple[str, ...] = ("chat", "code", "list", "random")

_CHAT_TEMPLATES: tuple[str, ...] = (
    "I am {}. What should I keep in mind?",
    "My neighbour keeps talking about {}. Can you help me understand the basics?",
    "Could you write a cheerful limerick about {}?",
    "What mistakes do people usually make when {}?",
    "Plan a relaxed Saturday around {} for me.",
    "Help me draft a polite message to my landlord about {}.",
    "What does an expert wish everyone knew about {}?",
    "Give me a two-paragraph pep talk for someone who is {}.",
)
_CHAT_TOPICS: tuple[str, ...] = (
    "repainting a kitchen", "adopting a retired greyhound", "starting a neighbourhood book club",
    "growing tomatoes on a balcony", "learning to juggle", "moving to a small apartment",
    "a leaking bathroom tap", "training for a first triathlon", "brewing kombucha at home",
    "restoring an old wooden chair", "planning a surprise birthday dinner",
    "keeping a sourdough starter alive", "hosting a board-game night for coworkers",
    "switching careers at forty", "visiting Lisbon for a weekend", "building a birdhouse",
)

_CODE_TEMPLATES: tuple[str, ...] = (
    "How do I write a Rust program that {}?",
    "Show me a SQL query that {}.",
    "Give me a bash one-liner that {}.",
    "In C, implement a small routine that {}.",
    "Write Go code that {}, and explain it briefly.",
)
_CODE_TASKS: tuple[str, ...] = (
    "lists the ten largest files under a directory", "groups orders by customer and sums totals",
    "parses one CSV line that may contain quoted commas", "rotates an array right by k places",
    "checks that brackets in an expression are balanced", "turns a Roman numeral into a number",
    "deduplicates lines of a log while keeping their order", "reports the busiest hour in a log",
    "computes a running average over a stream of readings", "renames photos by their date",
)

_LIST_TEMPLATES: tuple[str, ...] = (
    "Suggest {n} {} and why each one works.",
    "What are {n} {} worth knowing about?",
    "Rank {n} {} from easiest to hardest.",
    "Jot down {n} {}, one line each.",
)
_LIST_SUBJECTS: tuple[str, ...] = (
    "houseplants that tolerate low light", "cheap dinners for students",
    "warm-up stretches before cycling", "podcast ideas for amateur historians",
    "ways to welcome a new colleague", "card games that need only one deck",
    "weekend projects with an old laptop", "questions to ask a landlord before signing",
    "habits that keep a desk tidy", "day trips without a car",
)


def _crossed(templates: Sequence[str], items: Sequence[str], num: int, **fmt) -> list[str]:
    """`num` distinct template x item prompts, walking the diagonals so that consecutive
    prompts differ in both template and item."""
    total = len(templates) * len(items)
    if not 1 <= num <= total:
        raise ValueError(f"this family has {total} prompts; asked for {num}")
    out = []
    for i in range(total):
        template = templates[(i + i // len(items)) % len(templates)]
        out.append(template.format(items[i % len(items)], **fmt))
    return out[:num]


def family_size(family: str) -> int | None:
    """How many distinct prompts a family holds (None: unbounded, random tokens)."""
    sizes = {"chat": len(_CHAT_TEMPLATES) * len(_CHAT_TOPICS),
             "code": len(_CODE_TEMPLATES) * len(_CODE_TASKS),
             "list": len(_LIST_TEMPLATES) * len(_LIST_SUBJECTS)}
    if family == "random":
        return None
    if family not in sizes:
        raise ValueError(f"unknown prompt family {family!r}; choose from {', '.join(FAMILIES)}")
    return sizes[family]


def text_prompts(family: str, num: int) -> list[str]:
    """The first `num` user messages of a text family (chat, code, list)."""
    family_size(family)  # validates the name
    if family == "chat":
        return _crossed(_CHAT_TEMPLATES, _CHAT_TOPICS, num)
    if family == "code":
        return _crossed(_CODE_TEMPLATES, _CODE_TASKS, num)
    if family == "list":
        return _crossed(_LIST_TEMPLATES, _LIST_SUBJECTS, num, n=5)
    raise ValueError("random-token prompts are token ids: use random_token_prompts")


def random_token_prompts(num: int, vocab_size: int, exclude: Sequence[int] = (),
                         min_len: int = 32, max_len: int = 96, seed: int = 21
                         ) -> list[list[int]]:
    """`num` prompts of uniformly random token ids (lengths min_len..max_len), never an id in
    `exclude` (pass the special tokens). Seeded: the same ids on every machine."""
    if num < 1 or vocab_size < 2 or not 1 <= min_len <= max_len:
        raise ValueError("random_token_prompts needs num >= 1, vocab_size >= 2, "
                         "1 <= min_len <= max_len")
    banned = set(exclude)
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        ids: list[int] = []
        length = rng.randint(min_len, max_len)
        while len(ids) < length:
            token = rng.randrange(vocab_size)
            if token not in banned:
                ids.append(token)
        out.append(ids)
    return out
