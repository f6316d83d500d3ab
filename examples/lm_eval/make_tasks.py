"""Builds the two local lm-evaluation-harness datasets of this folder from the embedded TinyStories excerpt.

    python examples/lm_eval/make_tasks.py      # rewrites tinystories_stories.jsonl and tinystories_cloze.jsonl

- `tinystories_stories.jsonl`: the last 100 stories, one document each, for rolling-loglikelihood perplexity.
- `tinystories_cloze.jsonl`: 200 of those stories' endings to pick: the story without its last sentence, and its
  true last sentence among 3 last sentences of other stories (a fixed seed draws them), like StoryCloze.
"""

import json
import random
import re
from pathlib import Path

from egmla.data import EXCERPT

HERE = Path(__file__).resolve().parent
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def stories() -> list[str]:
    texts = [story.strip() for story in EXCERPT.read_text(encoding="utf-8").split("<|endoftext|>")]
    return [" ".join(story.split()) for story in texts if story]


def split_last_sentence(story: str) -> tuple[str, str] | None:
    sentences = SENTENCE_END.split(story)
    if len(sentences) < 3:
        return None
    return " ".join(sentences[:-1]), sentences[-1]


def main() -> None:
    documents = stories()
    held_out = documents[-100:]
    with open(HERE / "tinystories_stories.jsonl", "w", encoding="utf-8") as file:
        for story in held_out:
            file.write(json.dumps({"text": story}) + "\n")

    pairs = [pair for pair in map(split_last_sentence, documents[-260:]) if pair][-200:]
    endings = [ending for _, ending in pairs]
    generator = random.Random(0)
    with open(HERE / "tinystories_cloze.jsonl", "w", encoding="utf-8") as file:
        for index, (context, ending) in enumerate(pairs):
            others = generator.sample([e for i, e in enumerate(endings) if i != index and e != ending], 3)
            label = generator.randrange(4)
            choices = others[:label] + [ending] + others[label:]
            file.write(json.dumps({"context": context, "choices": choices, "label": label}) + "\n")
    print(f"{len(held_out)} stories, {len(pairs)} cloze items")


if __name__ == "__main__":
    main()
