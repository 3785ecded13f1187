"""The verse texts of the Bible corpus: OSIS markup to plain text, and the small fixes that make a Spanish
verse and an English verse say the same thing (the Spanish subscriptions, sentence-case verse openings).

Split from nmt/data/bible.py, which reads the modules, aligns the verses and writes the corpus.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Iterable

# Markup whose content is not translation text: notes (footnotes, cross references, alternative
# readings), Song of Songs speaker labels, and section titles that are not canonical.
_DROPPED_ELEMENTS = re.compile(
    r"<(note|speaker)\b[^>]*>.*?</\1>|<title\b(?![^>]*canonical=\"true\")[^>]*>.*?</title>", re.S
)
# The end of the book (`<div eID=... type="book"/>`) or the start of the WEB glossary: anything
# after it inside a verse entry belongs to no verse.
_END_OF_BOOK = re.compile(
    r"<div\b(?=[^>]*\beID=)(?=[^>]*\btype=\"book\")[^>]*/>|<div\b[^>]*\btype=\"glossary\""
)
# Elements that sit inside a line of text without separating words.
_INLINE_TAGS = re.compile(r"</?(?:w|q|hi|divineName|foreign|name|seg|reference|rdg|catchWord|abbr)\b[^>]*>")
_ANY_TAG = re.compile(r"<[^>]*>")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?)\]])")
_SPACE_AFTER_OPENER = re.compile(r"([¿¡(\[])\s+")


def clean_osis(markup: str) -> str:
    """Plain text of one verse: markup, notes and anything after the end of the book removed.

    Tags that separate words (line breaks, poetry lines, paragraphs, added-word spans) become a
    space, inline tags (Strong's `<w>`, quotes) vanish, entities are decoded, whitespace collapsed.
    """
    end = _END_OF_BOOK.search(markup)
    if end:
        markup = markup[: end.start()]
    text = _DROPPED_ELEMENTS.sub(" ", markup)
    text = _INLINE_TAGS.sub("", text)
    text = _ANY_TAG.sub(" ", text)
    text = html.unescape(text)
    text = " ".join(text.split())
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return _SPACE_AFTER_OPENER.sub(r"\1", text)


_LETTERS = re.compile(r"[^\W\d_]+")


def _is_caps_word(token: str) -> bool:
    letters = "".join(_LETTERS.findall(token))
    return len(letters) >= 2 and letters.isupper()


_WORD = re.compile(r"[^\W\d_]+")


def proper_nouns(texts: Iterable[str]) -> set[str]:
    """Words written capitalised more often than in lower case, first words of verses not counted."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(_WORD.findall(text.partition(" ")[2]))
    return {
        word
        for word, n in counts.items()
        if word[0].isupper() and not word.isupper() and n > counts[word.lower()]
    }


def sentence_case_opening(text: str, proper: set[str]) -> str:
    """Undo the printed chapter opening in capitals ("EN el principio" -> "En el principio").

    Reina-Valera sets the first word(s) of every chapter in capitals, also after a psalm title
    ("... su hijo. ¡OH Jehová"). The first run of all-capital words is re-cased: proper nouns
    (from `proper`) get a capital, the first word of a sentence too, everything else lower case.
    """
    tokens = text.split(" ")
    start = next((i for i, token in enumerate(tokens) if _is_caps_word(token)), None)
    if start is None:
        return text
    i = start
    while i < len(tokens) and _is_caps_word(tokens[i]):
        head = " ".join(tokens[:i]).rstrip("¿¡“‘\"'( ")
        sentence_start = not head or head[-1] in ".!?:"
        word = tokens[i].lower()
        core = word.strip("¿¡.,;:!?()“”‘’\"'")
        if sentence_start or core.capitalize() in proper:
            word = word.replace(core, core.capitalize(), 1)
        tokens[i] = word
        i += 1
    return " ".join(tokens)


_AMEN = "Amén."


def drop_subscription(spanish: str, english: str) -> str:
    """Cut the postscript Reina-Valera appends to the last verse of Paul's letters and Hebrews.

    "... sea con vosotros. Amén. Fué escrita á los Hebreos desde Italia" -> "... Amén.": the
    subscription is not scripture text and the WEB has none. Applied to the last verse of a book
    when the English verse ends with "Amen." and the Spanish one goes on after its last "Amén.".
    """
    end = spanish.rfind(_AMEN)
    if end < 0 or not english.endswith("Amen.") or end + len(_AMEN) == len(spanish):
        return spanish
    return spanish[: end + len(_AMEN)]


# --------------------------------------------------------------------------------------------
# Alignment checks
