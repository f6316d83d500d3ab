"""How egmla/data/wikipedia_*.txt were made: general English prose that no conversion stage fits on, for measuring
what a retrofit keeps outside its fitting text.

The source is the English Wikipedia dump excerpt that gensim 4.4.0 ships as test data
(`gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, CC BY-SA, Wikipedia
contributors). Each article's wiki markup is stripped by mwparserfromhell; its prose paragraphs (no headings, lists
or tables) are kept up to about 2,500 characters as one document; articles alternate between the choosing set
(tune on it) and the held-out set (report on it).

    pip download --no-deps --only-binary=:all: gensim==4.4.0 -d /tmp/gensim && pip install mwparserfromhell
    unzip -p /tmp/gensim/gensim-4.4.0-*.whl 'gensim/test/test_data/enwiki-*.bz2' | bunzip2 > /tmp/enwiki.xml
    python examples/make_wikipedia_excerpt.py /tmp/enwiki.xml egmla/data
"""

import html
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import mwparserfromhell

DOCUMENT_CHARACTERS = 2500


def articles(dump: Path):
    """(title, plain prose paragraphs) of every main-namespace article that is not a redirect."""
    root = ElementTree.parse(dump).getroot()
    namespace = root.tag[: root.tag.index("}") + 1]
    for page in root.iter(namespace + "page"):
        if page.find(namespace + "redirect") is not None or page.find(namespace + "ns").text != "0":
            continue
        text = page.find(f"{namespace}revision/{namespace}text").text or ""
        plain = mwparserfromhell.parse(text).strip_code(normalize=True, collapse=True)
        paragraphs = [re.sub(r"\s+", " ", html.unescape(line.strip())) for line in plain.split("\n")]
        prose = [line for line in paragraphs if is_prose(line)]
        if sum(map(len, prose)) > 1500:
            yield page.find(namespace + "title").text, prose


def is_prose(line: str) -> bool:
    """A paragraph of running text: long, with many words, no table or list markup left."""
    return len(line) >= 200 and line.count(" ") >= 30 and "|" not in line and not line.startswith(("*", "#", ":"))


def document(paragraphs: list[str]) -> str:
    """Whole paragraphs from the article's start, up to about DOCUMENT_CHARACTERS."""
    kept = []
    for paragraph in paragraphs:
        if kept and sum(map(len, kept)) + len(paragraph) > DOCUMENT_CHARACTERS:
            break
        kept.append(re.sub(r"\(\s*[,;]?\s*\)", "", paragraph))
    return "\n\n".join(kept)


def main(dump: Path, out: Path) -> None:
    sets = {"choosing": [], "held_out": []}
    for index, (title, paragraphs) in enumerate(articles(dump)):
        sets["choosing" if index % 2 == 0 else "held_out"].append((title, document(paragraphs)))
    for name, documents in sets.items():
        text = "\n<|endoftext|>\n".join(body for _, body in documents) + "\n"
        (out / f"wikipedia_{name}.txt").write_text(text)
        print(f"wikipedia_{name}.txt: {len(documents)} articles, {len(text):,} characters: "
              + "; ".join(title for title, _ in documents))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
