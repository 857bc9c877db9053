"""Chat prompts for training and evaluating the built-in EAGLE head (train / held-out split).

Owns two disjoint prompt sets, generated from seeded templates:

- `train_prompts(seed, prompt_set)`: a broad set (`base`, about 1,700 prompts) of chat
  (explain / story / poem / email / pros and cons ...), code, lists, arithmetic and word
  problems, rewriting and translation, short factual questions, and follow-up turns for
  multi-turn conversations (`FOLLOW_UPS`, asked after the model's own first answer); `wide`
  adds about 4,100 more from other templates, topics, programming languages and how / why
  questions (`new`: only those);
- `eval_prompts(num)`: up to 36 held-out chat prompts (default 24) on topics, code tasks, list
  items and numbers that no training prompt uses, so the measured acceptance is not memorised.
"""

from __future__ import annotations

import random

_CHAT_TEMPLATES: tuple[str, ...] = (
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
    "What is the most common misconception about {}?",
    "Write a short blog post about {}.",
    "How would you teach a beginner about {}?",
    "Compare {} with something from everyday life.",
    "What questions should I ask to learn more about {}?",
    "Tell me about {}.",
)

_TRAIN_TOPICS: tuple[str, ...] = (
    "the ocean", "photosynthesis", "the Roman Empire", "machine learning", "coffee",
    "volcanoes", "the moon", "healthy sleep", "electric cars", "chess", "bees", "the internet",
    "recycling", "dinosaurs", "music theory", "the human heart", "rainforests", "gravity",
    "learning a language", "saving money", "climate change", "the Eiffel Tower", "vaccines",
    "solar energy", "friendship", "cooking pasta", "the stock market", "black holes",
    "ancient Egypt", "running a marathon", "social media", "earthquakes", "honeybees",
    "the printing press", "video games", "meditation", "the water cycle", "robots", "tea",
    "public libraries", "time management", "the French Revolution", "DNA", "snow",
    "mountain climbing", "programming in Python", "birds migrating", "the Olympic Games",
    "bread baking", "electricity", "the solar system", "gardening", "penguins", "rivers",
    "the Renaissance", "smartphones", "yoga", "whales", "democracy", "the immune system",
    "airplanes", "cheese making", "the Amazon river", "renewable energy", "team work",
    "public speaking", "the human brain", "comets", "Shakespeare", "wind turbines",
    "chocolate", "the Industrial Revolution", "coral reefs", "first aid", "soccer",
    "photography", "the Middle Ages", "bacteria", "budgeting", "rain", "elephants",
    "the Great Depression", "cloud computing", "camping", "the piano", "trains", "glaciers",
    "antibiotics", "the Silk Road", "volunteering", "deep sea creatures", "cryptography",
    "the telescope", "nutrition", "the Moon landing", "ancient Greece", "cats", "dogs",
    "composting", "the violin", "hurricanes", "online privacy", "bridges", "sharks",
    "the metric system", "museums", "breakfast", "the Sahara", "fossils", "insects",
    "skyscrapers", "the Vikings", "habits", "minimalism", "forests", "electric guitars",
)

_CODE_TEMPLATES: tuple[str, ...] = (
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Explain how to write code that {}.",
    "Write a short Python script that {}, with comments.",
)

_TRAIN_CODE_TASKS: tuple[str, ...] = (
    "reverses a string", "checks whether a number is prime", "sums a list of numbers",
    "finds the largest element in a list", "counts the vowels in a word",
    "computes the factorial of n", "returns the n-th Fibonacci number",
    "sorts a list of names alphabetically", "removes duplicates from a list",
    "checks whether a word is a palindrome", "converts Celsius to Fahrenheit",
    "reads a text file and counts its lines", "merges two sorted lists",
    "finds the average of a list", "counts how often each word appears in a sentence",
    "checks whether a year is a leap year", "flattens a nested list",
    "returns the even numbers of a list", "capitalizes every word in a sentence",
    "computes the greatest common divisor of two numbers", "validates an email address",
    "generates a random password", "finds the second smallest number in a list",
    "converts a list of strings to integers", "prints a multiplication table",
    "checks whether two words are anagrams", "computes the area of a circle",
    "implements binary search", "counts the digits of an integer",
    "swaps the keys and values of a dictionary",
)

_LIST_TEMPLATES: tuple[str, ...] = (
    "List {n} {}.",
    "Give me a numbered list of {n} {}.",
    "Name {n} {} and say one thing about each.",
)

_TRAIN_LIST_ITEMS: tuple[str, ...] = (
    "fruits that are rich in vitamin C", "famous scientists", "ways to reduce stress",
    "countries in South America", "healthy breakfast ideas", "classic novels",
    "tips for a job interview", "animals that live in the Arctic", "board games for families",
    "ways to save water at home", "programming languages", "musical instruments",
    "things to pack for a trip", "hobbies you can do at home", "vegetables that grow fast",
    "inventions that changed the world", "ways to stay motivated", "types of clouds",
    "famous paintings", "exercises that need no equipment", "study techniques",
    "planets in our solar system", "kitchen tools every cook needs", "ways to be more polite",
    "reasons to learn history", "ingredients for a salad", "sports played with a ball",
)

_TRAIN_FACT_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?", "What is the capital of Japan?",
    "What is the capital of Canada?", "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "What is the largest planet in the solar system?", "Who painted the Mona Lisa?",
    "What gas do plants absorb from the air?", "How many continents are there?",
    "What is the chemical symbol for gold?", "What is the longest river in the world?",
    "How many days are in a leap year?", "What language is spoken in Brazil?",
    "What is the fastest land animal?", "What is the freezing point of water in Fahrenheit?",
    "Who developed the theory of relativity?", "What is the smallest prime number?",
    "How many hours are in a week?", "What is the hardest natural substance?",
)

_SENTENCES: tuple[str, ...] = (
    "the meeting was moved to next Tuesday because the manager is travelling",
    "i think we should buy a bigger car for the family trips",
    "the restaurant was crowded but the food arrived quickly",
    "please send me the report before the end of the day",
    "our team finished the project two weeks ahead of schedule",
    "the weather was cold so we stayed inside and read books",
    "she learned to play the guitar by watching videos online",
    "the new library opens on Monday with a special event for children",
    "he forgot his keys and had to wait for his sister",
    "we are looking for volunteers to help clean the park",
)

_REWRITE_TEMPLATES: tuple[str, ...] = (
    "Rewrite this sentence in a formal tone: {}",
    "Translate this sentence into French: {}",
    "Fix the grammar and punctuation: {}",
    "Turn this into a friendly text message: {}",
    "Summarize in five words: {}",
)

FOLLOW_UPS: tuple[str, ...] = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Make it shorter, please.",
    "What else should I know?",
    "Can you turn that into a list?",
    "Thank you! Can you add one more detail?",
)

# ---- the additional generators of the `wide` and `new` prompt sets ------------------------
_WIDE_CHAT_TEMPLATES: tuple[str, ...] = (
    "Write a haiku about {}.",
    "Explain the basic idea behind {} in one paragraph.",
    "What would a world without {} look like?",
    "Write a dialogue between two friends discussing {}.",
    "Give a short speech that celebrates {}.",
    "List the key terms someone needs to know about {}.",
    "Write a product description inspired by {}.",
    "What is the future of {}?",
    "Write a funny short anecdote about {}.",
    "Explain {} using an analogy.",
    "Create a quiz with three questions about {}.",
    "Write a diary entry from someone who loves {}.",
)
_WIDE_TOPICS: tuple[str, ...] = (
    "autumn leaves", "the postal service", "ice cream", "marathon training plans",
    "spiders", "the Arctic", "quantum physics", "street food", "the color blue", "clocks",
    "the Great Barrier Reef", "mushrooms", "electric scooters", "writing letters", "salt",
    "the alphabet", "wolves", "lightning", "museum guides", "pirates", "the human skeleton",
    "ancient Rome's roads", "keyboards", "bananas", "the Arabic numeral system", "maps",
    "opera", "fireworks", "windmills", "frogs", "the ozone layer", "dreams", "umbrellas",
    "neural networks", "the stars", "basketball", "cartoons", "tides", "wool", "the desert fox",
    "honey", "the Mars rovers", "zebras", "satellites", "jellyfish", "coins", "theatre",
    "potatoes", "the speed of light", "farmers markets", "ballet", "the blue whale",
    "podcasts", "lemons", "canals", "chemistry sets", "rice", "the Pacific Ocean", "tigers",
    "handwriting", "ferries", "the bicycle helmet", "old radios", "magnets", "cranes",
    "pyramids", "the Internet of Things", "gold", "volunteer firefighters", "parrots",
)
_WIDE_CODE_TEMPLATES: tuple[str, ...] = (
    "Write a TypeScript function that {}.",
    "Write a Java method that {}.",
    "Write a C++ function that {}.",
    "Write a Ruby method that {}.",
    "Implement in Python a function that {}, and add a docstring.",
    "Write a Python class that {}.",
)
_WIDE_CODE_TASKS: tuple[str, ...] = (
    "counts the words in a paragraph", "returns the last n items of a list",
    "converts a number to binary", "checks whether a list is sorted",
    "finds the longest word in a sentence", "computes the sum of the digits of a number",
    "returns the intersection of two lists", "converts a string to title case",
    "computes the power of a number without using the built-in operator",
    "stores a shopping cart and its total price", "keeps a stack of integers",
    "splits a list into chunks of size n", "finds the most frequent element",
    "checks whether a string contains only digits", "computes compound interest",
)
_WIDE_LIST_TEMPLATES: tuple[str, ...] = (
    "Write down {n} {}.",
    "Can you list {n} {} with a short explanation?",
    "I need {n} {}. Please number them.",
)
_WIDE_LIST_ITEMS: tuple[str, ...] = (
    "famous mountains", "breakfast foods from around the world", "ways to learn faster",
    "animals that can fly", "ideas for a birthday gift", "rivers in Europe",
    "safety tips for cooking", "famous composers", "things that are made of glass",
    "benefits of walking", "ways to reduce plastic waste", "reasons to read books",
    "popular dog breeds", "desserts made with apples", "skills every adult should have",
    "games children play outside", "common English idioms", "fun facts about the sea",
)
_WIDE_QUESTIONS: tuple[str, ...] = (
    "How does a refrigerator work?", "Why is the sky blue?", "How do airplanes stay in the air?",
    "What causes the seasons?", "How does the heart pump blood?",
    "Why do cats purr?", "How do bees make honey?", "What is inflation?",
    "Why do we need sleep?", "How does a compass work?", "What is a prime number?",
    "How does soap clean things?", "Why do leaves change color?", "What is an algorithm?",
    "How do vaccines train the immune system?", "What is the difference between weather "
    "and climate?", "How does a battery store energy?", "Why is exercise good for you?",
)


def _wide_prompts(rng: random.Random) -> list[str]:
    prompts = [t.format(topic) for topic in _WIDE_TOPICS for t in _WIDE_CHAT_TEMPLATES]
    prompts += [t.format(topic) for topic in _WIDE_TOPICS for t in _CHAT_TEMPLATES]
    prompts += [t.format(topic) for topic in _TRAIN_TOPICS for t in _WIDE_CHAT_TEMPLATES]
    prompts += [t.format(task) for task in _WIDE_CODE_TASKS + _TRAIN_CODE_TASKS
                for t in _WIDE_CODE_TEMPLATES]
    prompts += [t.format(task) for task in _WIDE_CODE_TASKS for t in _CODE_TEMPLATES]
    prompts += [t.format(item, n=n) for item in _WIDE_LIST_ITEMS + _TRAIN_LIST_ITEMS
                for t, n in zip(_WIDE_LIST_TEMPLATES, (4, 6, 8))]
    prompts += list(_WIDE_QUESTIONS)
    prompts += _maths(rng, 300)
    return prompts


# ---- held out: none of these words or numbers appear in a training prompt --------------------
_EVAL_TOPICS: tuple[str, ...] = (
    "lighthouses", "origami", "the Great Wall of China", "jazz", "octopuses", "bicycles",
    "thunderstorms", "the periodic table", "hot air balloons", "deserts", "paper money", "owls",
    "submarines", "the Aztecs", "kites", "sunflowers", "castles", "sign language",
)
_EVAL_MORE_TOPICS: tuple[str, ...] = (  # after the first 26 held-out prompts, in this order
    "the Northern Lights", "pottery", "the Titanic", "knitting", "rainbows", "tornadoes",
    "the Statue of Liberty", "crossword puzzles", "hedgehogs", "skateboarding",
)
_EVAL_CODE_TASKS: tuple[str, ...] = (
    "counts the uppercase letters in a string", "returns the median of a list",
    "converts minutes to hours and minutes",
)
_EVAL_LIST_ITEMS: tuple[str, ...] = (
    "ways to make a small room feel bigger", "famous bridges", "rainy day activities",
)


def _maths(rng: random.Random, num: int) -> list[str]:
    """Arithmetic, percentages, equations and word problems with random numbers."""
    out = []
    for _ in range(num):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
        kind = rng.randrange(7)
        if kind == 0:
            out.append(f"What is {a} + {b}?")
        elif kind == 1:
            out.append(f"What is {a} times {c}?")
        elif kind == 2:
            out.append(f"What is {c * 5}% of {a * 10}?")
        elif kind == 3:
            out.append(f"Solve for x: {c}x + {a} = {c * b + a}.")
        elif kind == 4:
            out.append(f"A shop sells pens for {c} dollars each. How much do {b} pens cost?")
        elif kind == 5:
            out.append(
                f"A train travels at {a} km per hour for {c} hours. How far does it go?"
            )
        else:
            out.append(f"Tom has {a} apples and gives {min(a - 1, b)} to his friend. "
                       "How many apples does he have left? Explain step by step.")
    return out


PROMPT_SETS: tuple[str, ...] = ("base", "wide", "new")


def train_prompts(seed: int = 0, prompt_set: str = "base") -> list[str]:
    """The training prompts (single user turns), shuffled with `seed`: `base` the broad set the
    shipped head was trained on; `wide` the same followed by about 4,000 more from other
    templates, topics, languages and questions; `new` only those (to continue a head trained on
    `base`)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {prompt_set!r}; choose from {PROMPT_SETS}")
    rng = random.Random(seed)
    prompts = [t.format(topic) for topic in _TRAIN_TOPICS for t in _CHAT_TEMPLATES]
    rng.shuffle(prompts)
    prompts = prompts[:1200]  # templates x topics is large; a random 1,200 of them
    prompts += [t.format(task) for task in _TRAIN_CODE_TASKS for t in _CODE_TEMPLATES]
    prompts += [
        t.format(item, n=n)
        for item in _TRAIN_LIST_ITEMS
        for t, n in zip(_LIST_TEMPLATES, (3, 5, 7))
    ]
    prompts += list(_TRAIN_FACT_QUESTIONS)
    prompts += [t.format(s) for s in _SENTENCES for t in _REWRITE_TEMPLATES]
    prompts += _maths(rng, 200)
    rng.shuffle(prompts)
    if prompt_set == "base":
        return prompts
    seen = set(prompts)
    extra = [p for p in dict.fromkeys(_wide_prompts(rng)) if p not in seen]
    rng.shuffle(extra)
    return prompts + extra if prompt_set == "wide" else extra


def eval_prompts(num: int | None = 24) -> list[str]:
    """The first `num` held-out prompts (None: all): mostly chat on unseen topics, some code,
    lists and maths."""
    chat = [
        _CHAT_TEMPLATES[(i * 3) % len(_CHAT_TEMPLATES)].format(topic)
        for i, topic in enumerate(_EVAL_TOPICS)
    ]
    code = [_CODE_TEMPLATES[i % 2].format(task) for i, task in enumerate(_EVAL_CODE_TASKS)]
    lists = [_LIST_TEMPLATES[i % 3].format(item, n=4) for i, item in enumerate(_EVAL_LIST_ITEMS)]
    maths = ["What is 113 + 245?", "A bus carries 14 people on each trip. How many people "
             "does it carry in 17 trips?"]
    # interleave so that any prefix of the list mixes the kinds
    mixed: list[str] = []
    extras = [*code, *lists, *maths]
    for i, prompt in enumerate(chat):
        mixed.append(prompt)
        if i % 2 == 1 and extras:
            mixed.append(extras.pop(0))
    mixed += extras
    mixed += [_CHAT_TEMPLATES[(i * 5 + 1) % len(_CHAT_TEMPLATES)].format(topic)
              for i, topic in enumerate(_EVAL_MORE_TOPICS)]
    if num is None:
        return mixed
    if not 1 <= num <= len(mixed):
        raise ValueError(f"there are {len(mixed)} held-out prompts; asked for {num}")
    return mixed[:num]
