"""Built-in prompts for draft-head self-distillation (train_draft.py): chat requests made from task templates x
topics, and raw text openings. The target writes its own continuations of these, so no data set is downloaded.
The benchmark prompts of benchmarks/bench_spec.py are not among them."""

from __future__ import annotations

CHAT_TEMPLATES = [
    "Explain {t} to a beginner in a few sentences.",
    "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a Python function related to {t}, with a short docstring and an example.",
    "Summarize the history of {t} in one paragraph.",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}, and answer the first one.",
    "How would you teach {t} to a ten-year-old?",
    "Write an email to a friend recommending {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Describe a typical day for someone who works with {t}.",
    "What are common mistakes people make with {t}?",
    "Write step-by-step instructions for getting started with {t}.",
    "Give a numbered list of tips about {t}.",
    "Write a dialogue between two people discussing {t}.",
]

TOPICS = [
    "photosynthesis", "the solar system", "machine learning", "cooking pasta", "the French revolution",
    "climate change", "sorting algorithms", "the human heart", "electric cars", "volcanoes", "chess",
    "the stock market", "honey bees", "recursion", "the Roman empire", "healthy sleep", "black holes",
    "gardening", "linked lists", "the water cycle", "learning a language", "jazz music", "the internet",
    "renewable energy", "dinosaurs", "SQL databases", "time management", "the moon landing", "coffee",
    "prime numbers", "rainforests", "public speaking", "regular expressions", "the immune system",
    "ancient Egypt", "bicycles", "unit testing", "the ocean", "meditation", "hash maps", "football",
    "vaccines", "origami", "the printing press", "binary search", "mountains", "friendship", "robots",
]

RAW_OPENINGS = [
    "Once upon a time, in a small village by the sea,",
    "The most important thing to remember about programming is",
    "def fibonacci(n):\n",
    "import numpy as np\n\ndef normalize(x):\n",
    "In 1969, astronauts",
    "The recipe calls for the following ingredients:\n1.",
    "Dear Sir or Madam,\n\nI am writing to",
    "Chapter 1\n\nThe rain had not stopped for three days",
    "Q: What is the boiling point of water?\nA:",
    "class Stack:\n    def __init__(self):\n",
    "The key differences between cats and dogs are",
    "Here is a list of the planets in our solar system:\n",
    "for i in range(10):\n",
    "The meeting will begin at 9 a.m. and the agenda is as follows:",
    "Water is made of",
    "#include <stdio.h>\n\nint main(void) {\n",
    "The history of mathematics begins",
    "To make a paper airplane, first",
    "SELECT name, age FROM users WHERE",
    "The weather today is",
    "A good way to start the morning is",
    "The function below reads a file and counts the words:\n\n",
    "My favourite book is",
    "Step 1: Preheat the oven to",
]


def chat_prompts() -> list[str]:
    """Every template with every topic, interleaved so that any prefix of the list mixes tasks and topics."""
    out = []
    for i in range(len(TOPICS) * len(CHAT_TEMPLATES)):
        out.append(CHAT_TEMPLATES[i % len(CHAT_TEMPLATES)].format(t=TOPICS[(i // len(CHAT_TEMPLATES) + i)
                                                                           % len(TOPICS)]))
    return list(dict.fromkeys(out))
