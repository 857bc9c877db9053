"""Chat prompts for training and evaluating the built-in EAGLE head (train / held-out split).

Owns two disjoint prompt sets: training prompts (templates x topics) and held-out evaluation
prompts (topics never seen in training), so the measured acceptance length is not memorised.
"""

from __future__ import annotations

_TEMPLATES: tuple[str, ...] = (
    "Explain {} in simple terms.",
    "Write a short poem about {}.",
    "What are three interesting facts about {}?",
    "Give me some practical tips about {}.",
    "Write a short story that involves {}.",
    "Why is {} important?",
    "Summarize the history of {}.",
    "Describe {} to a ten-year-old.",
    "What are the pros and cons of {}?",
    "Write an email to a friend about {}.",
)

_TRAIN_TOPICS: tuple[str, ...] = (
    "the ocean",
    "photosynthesis",
    "the Roman Empire",
    "machine learning",
    "coffee",
    "volcanoes",
    "the moon",
    "healthy sleep",
    "electric cars",
    "chess",
    "bees",
    "the internet",
    "recycling",
    "dinosaurs",
    "music theory",
    "the human heart",
    "rainforests",
    "gravity",
    "learning a language",
    "saving money",
    "climate change",
    "the Eiffel Tower",
    "vaccines",
    "solar energy",
    "friendship",
    "cooking pasta",
    "the stock market",
    "black holes",
    "ancient Egypt",
    "running a marathon",
    "social media",
    "earthquakes",
    "honeybees",
    "the printing press",
    "video games",
    "meditation",
    "the water cycle",
    "robots",
    "tea",
    "public libraries",
    "time management",
    "the French Revolution",
    "DNA",
    "snow",
    "mountain climbing",
    "programming in Python",
    "birds migrating",
    "the Olympic Games",
    "bread baking",
    "electricity",
    "the solar system",
    "gardening",
    "penguins",
)

_EVAL_TOPICS: tuple[str, ...] = (
    "lighthouses",
    "origami",
    "the Great Wall of China",
    "jazz",
    "octopuses",
    "bicycles",
    "thunderstorms",
    "the periodic table",
    "board games",
    "deserts",
    "paper money",
    "owls",
)


def train_prompts() -> list[str]:
    return [t.format(topic) for topic in _TRAIN_TOPICS for t in _TEMPLATES]


def eval_prompts(num: int = 12) -> list[str]:
    """Held-out prompts (topics absent from training), templates cycled."""
    return [
        _TEMPLATES[(i * 3) % len(_TEMPLATES)].format(topic)
        for i, topic in enumerate(_EVAL_TOPICS[:num])
    ]
