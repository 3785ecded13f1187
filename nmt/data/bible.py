"""Build the embedded Spanish→English corpus: Reina-Valera 1909 ↔ World English Bible, verse-aligned.

Why this corpus: both texts are public domain and ship as Debian packages (`sword-text-sparv`,
`sword-text-web`), so a fresh machine gets ~31k real sentence pairs with no download from the web
and no licence question. Why this module does more than "read verse, write line":

* pysword re-inflates a whole book for every verse it returns; we cache the decompressed blocks
  so that extracting both Bibles takes about a second instead of minutes.
* The modules carry OSIS markup: Strong's numbers (`<w lemma=...>`), footnotes and cross
  references (`<note>`), poetry lines, speaker labels, and, in the WEB module, a whole glossary
  stored after Revelation 22:21. All of that is stripped or cut; canonical psalm titles are kept
  because the Spanish text carries them inside verse 1 as well.
* The Spanish module keeps Spanish verse numbering inside the KJV scheme. Where the two differ it
  leaves KJV slots empty and merges or shifts the neighbouring verses, so in those places verse N
  in Spanish is not verse N in English. We drop every chapter with such an empty Spanish slot and
  every chapter right after one whose verse lengths show the shift (see `find_misaligned_chapters`).
* Dev and test are whole books, never seen in training, and free of dropped chapters.

Everything is deterministic: the same modules give byte-identical files.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import math
import os
import re
import shutil
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SWORD_DIR = Path("/usr/share/sword")
SPANISH_MODULE = "spaRV1909eb"  # Debian package sword-text-sparv
ENGLISH_MODULE = "engWEB2015eb"  # Debian package sword-text-web
MODULE_PACKAGES = {SPANISH_MODULE: "sword-text-sparv", ENGLISH_MODULE: "sword-text-web"}

# Whole books held out (OSIS ids). Mixed genres; none has a dropped chapter or a known
# renumbering; see docs/data.md for the counts.
DEV_BOOKS: tuple[str, ...] = ("Ruth", "Lam", "Phil", "Col", "1Thess")
TEST_BOOKS: tuple[str, ...] = ("Josh", "Eccl", "Amos", "Gal", "Eph", "Jas")
SPLITS = ("train", "dev", "test")

# A chapter after an empty Spanish slot counts as shifted when pairing each Spanish verse with an
# English verse k positions away (0 < |k| <= MAX_SHIFT) fits the verse lengths better than the
# same number by more than SHIFT_MARGIN (mean absolute log length ratio). Shifted chapters score
# 0.10 to 0.37 better; aligned ones score worse with every shift.
MAX_SHIFT = 6
SHIFT_MARGIN = 0.05


class BibleCorpusError(RuntimeError):
    """The SWORD modules are missing or unreadable, or the output cannot be written."""


@dataclass(frozen=True, order=True)
class VerseRef:
    """A verse in the KJV numbering scheme; `book` is the OSIS id ("Gen", "John", ...)."""

    book: str
    chapter: int
    verse: int

    def __str__(self) -> str:
        return f"{self.book} {self.chapter}:{self.verse}"


# --------------------------------------------------------------------------------------------
# Reading the SWORD modules


def _module_error(sword_dir: Path, module: str, what: str) -> BibleCorpusError:
    package = MODULE_PACKAGES.get(module, "the package that provides it")
    return BibleCorpusError(
        f"SWORD module '{module}' {what} under {sword_dir}: run apt-get install {package} "
        f"(or pass --sword-dir DIR pointing at a SWORD library with mods.d/)"
    )


def open_module(sword_dir: Path, module: str):
    """Open a SWORD Bible module with pysword, caching decompressed blocks.

    Args:
        sword_dir: SWORD library root (holds `mods.d/` and `modules/`).
        module: module name as in its `mods.d/*.conf` section, e.g. "engWEB2015eb".

    Returns a `pysword.bible.SwordBible`; raises BibleCorpusError with the fix when it cannot.
    """
    try:
        from pysword.modules import SwordModules
    except ImportError as err:
        raise BibleCorpusError(
            "pysword is not installed: run pip install 'pysword>=0.2.8' (or pip install -e '.[bible]')"
        ) from err
    if not (sword_dir / "mods.d").is_dir():
        raise _module_error(sword_dir, module, "not found (no mods.d/ directory)")
    modules = SwordModules(str(sword_dir))
    found = modules.parse_modules()
    if module not in found:
        raise _module_error(sword_dir, module, f"not found (found: {', '.join(sorted(found)) or 'none'})")
    try:
        bible = modules.get_bible_from_module(module)
    except (OSError, ValueError, KeyError) as err:
        raise _module_error(sword_dir, module, f"is unreadable ({err})") from err
    # pysword inflates the whole compressed block (one book) for every single verse; caching the
    # inflated blocks turns minutes into a second. The cache lives and dies with this object.
    if hasattr(bible, "_decompressed_text"):
        bible._decompressed_text = functools.lru_cache(maxsize=None)(bible._decompressed_text)
    return bible


def module_info(sword_dir: Path, module: str) -> dict[str, str]:
    """Name, description and version of a module, from its mods.d conf file (for split.json)."""
    from pysword.modules import SwordModules

    conf = SwordModules(str(sword_dir)).parse_modules().get(module, {})
    keys = ("description", "version", "swordversiondate", "versification", "distributionlicense")
    return {"module": module, "package": MODULE_PACKAGES.get(module, ""),
            **{key: conf.get(key, "") for key in keys}}


def book_order(bible) -> list[tuple[str, list[int]]]:
    """(OSIS id, verses per chapter) for every book of the module's versification, in canon order."""
    books = bible.get_structure().get_books()
    return [(book.osis_name, list(book.chapter_lengths)) for testament in ("ot", "nt")
            for book in books.get(testament, [])]


def read_verses(bible, books: Iterable[str]) -> dict[VerseRef, str]:
    """Raw OSIS text of every verse of `books` (OSIS ids) in the module's own versification.

    Verses the module has no text for are ''.
    """
    wanted = set(books)
    verses: dict[VerseRef, str] = {}
    for book, chapter_lengths in book_order(bible):
        if book not in wanted:
            continue
        for chapter, length in enumerate(chapter_lengths, start=1):
            texts = list(bible.get_iter(books=book, chapters=chapter, clean=False))
            if len(texts) != length:
                raise BibleCorpusError(f"{book} {chapter}: expected {length} verses, pysword returned "
                                       f"{len(texts)}; is the installed pysword >= 0.2.8?")
            for verse, text in enumerate(texts, start=1):
                verses[VerseRef(book, chapter, verse)] = text or ""
    return verses


# --------------------------------------------------------------------------------------------
# Cleaning


# Markup whose content is not translation text: notes (footnotes, cross references, alternative
# readings), Song of Songs speaker labels, and section titles that are not canonical.
_DROPPED_ELEMENTS = re.compile(
    r"<(note|speaker)\b[^>]*>.*?</\1>|<title\b(?![^>]*canonical=\"true\")[^>]*>.*?</title>", re.S)
# The end of the book (`<div eID=... type="book"/>`) or the start of the WEB glossary: anything
# after it inside a verse entry belongs to no verse.
_END_OF_BOOK = re.compile(
    r"<div\b(?=[^>]*\beID=)(?=[^>]*\btype=\"book\")[^>]*/>|<div\b[^>]*\btype=\"glossary\"")
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
        markup = markup[:end.start()]
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


def proper_nouns(texts: Iterable[str]) -> set[str]:
    """Words written capitalised more often than lower-case when not first in a verse."""
    counts: Counter[str] = Counter()
    for text in texts:
        for token in text.split()[1:]:
            word = token.strip("¿¡.,;:!?()“”‘’\"'")
            if word and not _is_caps_word(word):
                counts[word] += 1
    return {word for word, n in counts.items() if word[:1].isupper() and n > counts[word.lower()]}


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


# --------------------------------------------------------------------------------------------
# Alignment checks


def _log_ratio(spanish: str, english: str) -> float:
    return math.log(len(spanish) / len(english))


def _shift_score(es: dict[VerseRef, str], en: dict[VerseRef, str], book: str, chapter: int,
                 verses: list[int], shift: int, centre: float) -> float | None:
    """Mean |log length ratio - centre| pairing Spanish verse v with English verse v + shift."""
    deviations = []
    for verse in verses:
        spanish = es[VerseRef(book, chapter, verse)]
        english = en.get(VerseRef(book, chapter, verse + shift), "")
        if spanish and english:
            deviations.append(abs(_log_ratio(spanish, english) - centre))
    return sum(deviations) / len(deviations) if len(deviations) >= 3 else None


def best_shift(es: dict[VerseRef, str], en: dict[VerseRef, str], chapter: tuple[str, int],
               verses: list[int], centre: float) -> tuple[int, float, float]:
    """(shift, misfit at shift 0, misfit at that shift) for the best English offset of a chapter.

    Returns shift 0 when no offset in +-MAX_SHIFT fits better, or when the chapter is too short.
    """
    same = _shift_score(es, en, *chapter, verses, 0, centre)
    if same is None:
        return 0, 0.0, 0.0
    best, shift = same, 0
    for k in range(-MAX_SHIFT, MAX_SHIFT + 1):
        score = _shift_score(es, en, *chapter, verses, k, centre) if k else None
        if score is not None and score < best:
            best, shift = score, k
    return shift, same, best


def find_misaligned_chapters(es: dict[VerseRef, str], en: dict[VerseRef, str]) -> dict[tuple[str, int], str]:
    """Chapters whose Spanish and English verse numbers do not match, with the reason.

    Args:
        es, en: cleaned text per verse (same keys; '' where a module has no text).

    Two rules, both visible in the data: (1) a chapter with an empty Spanish slot where English
    has text has Spanish verses merged or moved around that slot; (2) the chapter right after
    such a slot is dropped too when its verse lengths fit better with a shift (the Spanish text
    moved into it). Returns {(book, chapter): reason}, in canon order.
    """
    chapters: dict[tuple[str, int], list[int]] = defaultdict(list)
    for ref in es:
        chapters[(ref.book, ref.chapter)].append(ref.verse)
    pairs = [_log_ratio(es[ref], en[ref]) for ref in es if es[ref] and en.get(ref)]
    centre = statistics.median(pairs) if pairs else 0.0
    order = list(chapters)
    misaligned: dict[tuple[str, int], str] = {}
    for index, (book, chapter) in enumerate(order):
        empty = [v for v in chapters[(book, chapter)]
                 if not es[VerseRef(book, chapter, v)] and en.get(VerseRef(book, chapter, v))]
        if not empty:
            continue
        slots = ", ".join(str(v) for v in empty)
        misaligned[(book, chapter)] = f"Spanish verse(s) {slots} empty: neighbouring verses merged or moved"
        following = order[index + 1] if index + 1 < len(order) else None
        if following is None or following[0] != book:
            continue
        shift, same, best = best_shift(es, en, following, chapters[following], centre)
        if shift and same - best > SHIFT_MARGIN:
            misaligned.setdefault(following, (
                f"verses shifted by {shift:+d} after the empty Spanish slot(s) of {book} {chapter} "
                f"(length misfit {same:.2f}, shifted {best:.2f})"))
    return {key: misaligned[key] for key in order if key in misaligned}


# --------------------------------------------------------------------------------------------
# Building


def split_of(book: str) -> str:
    """The split a book belongs to: whole books go to dev or test, the rest to train."""
    if book in DEV_BOOKS:
        return "dev"
    if book in TEST_BOOKS:
        return "test"
    return "train"


def extract_pairs(sword_dir: Path = DEFAULT_SWORD_DIR, books: Iterable[str] | None = None
                  ) -> tuple[list[tuple[VerseRef, str, str]], dict]:
    """Read both modules and return aligned (ref, spanish, english) pairs plus a report.

    Args:
        sword_dir: SWORD library root.
        books: OSIS ids to extract (default: all 66 books of the KJV canon).

    The report holds the dropped chapters with reasons and counts of skipped empty verses.
    """
    sword_dir = Path(sword_dir)
    spanish_bible = open_module(sword_dir, SPANISH_MODULE)
    english_bible = open_module(sword_dir, ENGLISH_MODULE)
    canon = book_order(spanish_bible)  # KJV: the scheme both texts are compared in
    if books is not None:
        wanted = list(books)
        known = {book for book, _ in canon}
        unknown = [book for book in wanted if book not in known]
        if unknown:
            raise BibleCorpusError(f"unknown book id(s) {', '.join(unknown)}: use OSIS ids such as "
                                   f"{', '.join(b for b, _ in canon[:3])}, ... (see docs/data.md)")
        canon = [(book, lengths) for book, lengths in canon if book in wanted]
    book_ids = [book for book, _ in canon]
    es = {ref: clean_osis(text) for ref, text in read_verses(spanish_bible, book_ids).items()}
    en_all = {ref: clean_osis(text) for ref, text in read_verses(english_bible, book_ids).items()}
    # The WEB uses NRSVA numbering, which has two slots more than KJV (3John 1:15, Rev 12:18);
    # the module leaves them empty. Text there would have no Spanish partner: say so, don't lose it quietly.
    extra = [str(ref) for ref, text in en_all.items() if text and ref not in es]
    en = {ref: en_all.get(ref, "") for ref in es}
    proper = proper_nouns(es.values())
    es = {ref: sentence_case_opening(text, proper) if ref.verse == 1 else text for ref, text in es.items()}

    dropped = find_misaligned_chapters(es, en)
    pairs: list[tuple[VerseRef, str, str]] = []
    skipped: Counter[str] = Counter()
    english_omissions: list[str] = []  # verses the WEB leaves out (textual variants), kept in Spanish
    for ref in es:  # canon order
        if (ref.book, ref.chapter) in dropped:
            continue
        if es[ref] and en[ref]:
            pairs.append((ref, es[ref], en[ref]))
        elif es[ref]:
            skipped["english_empty"] += 1
            english_omissions.append(str(ref))
        else:
            skipped["spanish_empty" if en[ref] else "both_empty"] += 1
    verses_per_chapter = Counter((ref.book, ref.chapter) for ref in es)
    report = {
        "dropped_chapters": [{"chapter": f"{book} {chapter}", "verses": verses_per_chapter[(book, chapter)],
                              "reason": reason} for (book, chapter), reason in dropped.items()],
        "skipped_verses": {**skipped, "english_empty_refs": english_omissions, "english_only_refs": extra},
    }
    return pairs, report


def _write_atomically(out_dir: Path, files: dict[str, str]) -> None:
    """Write all files into a fresh sibling directory, then move each into place with os.replace."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bible-", dir=out_dir))
    try:
        for name, content in files.items():
            (staging / name).write_text(content, encoding="utf-8", newline="\n")
        for name in files:
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_bible_corpus(out_dir: Path, sword_dir: Path = DEFAULT_SWORD_DIR,
                       books: Iterable[str] | None = None) -> dict[str, int]:
    """Build DIR/{train,dev,test}.{es,en} and DIR/split.json from the installed SWORD modules.

    Args:
        out_dir: output directory (created if missing; existing corpus files are replaced).
        sword_dir: SWORD library root holding the spaRV1909eb and engWEB2015eb modules.
        books: OSIS ids to build (default: all 66); a subset is for tests and quick looks.

    Returns the number of verse pairs per split, e.g. {"train": 27000, "dev": 1100, "test": 2000}.
    Raises BibleCorpusError with the fix when the modules are missing or the output not writable.
    """
    out_dir = Path(out_dir)
    pairs, report = extract_pairs(Path(sword_dir), books)
    lines: dict[str, tuple[list[str], list[str]]] = {split: ([], []) for split in SPLITS}
    books_in: dict[str, list[str]] = {split: [] for split in SPLITS}
    for ref, spanish, english in pairs:
        split = split_of(ref.book)
        lines[split][0].append(spanish)
        lines[split][1].append(english)
        if ref.book not in books_in[split]:
            books_in[split].append(ref.book)
    counts = {split: len(lines[split][0]) for split in SPLITS}

    files: dict[str, str] = {}
    for split in SPLITS:
        for lang, column in (("es", 0), ("en", 1)):
            files[f"{split}.{lang}"] = "".join(line + "\n" for line in lines[split][column])
    split_info = {
        "description": "Spanish Reina-Valera 1909 -> English World English Bible, one verse per line",
        "sources": {"es": module_info(Path(sword_dir), SPANISH_MODULE),
                    "en": module_info(Path(sword_dir), ENGLISH_MODULE)},
        "verse_scheme": "KJV (the Spanish module's); verses empty on either side are skipped",
        "counts": counts,
        "books": books_in,
        "held_out_books": {"dev": list(DEV_BOOKS), "test": list(TEST_BOOKS)},
        **report,
        "sha256": {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in files.items()},
    }
    files["split.json"] = json.dumps(split_info, ensure_ascii=False, indent=2) + "\n"
    try:
        _write_atomically(out_dir, files)
    except OSError as err:
        raise BibleCorpusError(f"cannot write the corpus to {out_dir}: {err.strerror or err}; "
                               f"choose a writable directory with --out") from err
    return counts
