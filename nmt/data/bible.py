"""Build the embedded Spanish→English corpus: Reina-Valera 1909 ↔ World English Bible, verse-aligned.

Why this corpus: both texts are public domain and ship as Debian packages (`sword-text-sparv`,
`sword-text-web`), so a fresh machine gets ~31k real sentence pairs with no download from the web
and no licence question. Why this module does more than "read verse, write line":

* pysword re-inflates a whole book for every verse it returns; we cache the decompressed blocks
  so that reading both Bibles takes a third of a second instead of about two minutes.
* The modules carry OSIS markup: Strong's numbers (`<w lemma=...>`), footnotes and cross
  references (`<note>`), poetry lines, speaker labels, and, in the WEB module, a whole glossary
  stored after Revelation 22:21. All of that is stripped or cut; canonical psalm titles are kept
  because the Spanish text carries them inside verse 1 as well.
* The Spanish module keeps Spanish verse numbering inside the KJV scheme. Where the two differ it
  leaves KJV slots empty and merges or shifts the neighbouring verses, so in those places verse N
  in Spanish is not verse N in English. We drop every chapter with such an empty Spanish slot and
  every chapter whose verse lengths show a shift, after such a slot or locally (1 Chronicles 21);
  see `find_misaligned_chapters`.
* Dev and test are whole books, never seen in training, and free of dropped chapters.

Everything is deterministic: the same modules give byte-identical files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nmt.data.bible_text import clean_osis, drop_subscription, proper_nouns, sentence_case_opening

DEFAULT_SWORD_DIR = Path("/usr/share/sword")
SPANISH_MODULE = "spaRV1909eb"  # Debian package sword-text-sparv
ENGLISH_MODULE = "engWEB2015eb"  # Debian package sword-text-web
MODULE_PACKAGES = {SPANISH_MODULE: "sword-text-sparv", ENGLISH_MODULE: "sword-text-web"}

# Whole books held out (OSIS ids), of mixed genre: narrative, poetry or wisdom, prophecy, letters.
# None has a dropped chapter, a local renumbering or a close parallel text left in training (no
# Gospel, no Kings/Chronicles); see docs/data.md for the counts.
DEV_BOOKS: tuple[str, ...] = ("Ruth", "Esth", "Lam", "Dan", "Joel", "Phil", "Col", "1Thess")
TEST_BOOKS: tuple[str, ...] = ("Josh", "Eccl", "Amos", "Mic", "Gal", "Eph", "Heb", "Jas", "1Pet")
SPLITS = ("train", "dev", "test")

# A chapter after an empty Spanish slot counts as shifted when pairing each Spanish verse with the
# English verse k positions away (0 < |k| <= MAX_SHIFT) fits the verse lengths better than the
# same number by more than SHIFT_MARGIN (mean gain in |log length ratio - median|). In the
# installed modules the shifted chapters gain 0.08 to 0.37; the aligned chapters after a slot fit
# worse with every offset.
MAX_SHIFT = 6
SHIFT_MARGIN = 0.05
# Renumbering without an empty slot (1 Chronicles 21, 1 Kings 22): some WINDOW consecutive verses
# fit an offset of one verse better by more than WINDOW_MARGIN. The misaligned chapters gain 0.30
# to 0.51; the best aligned chapter (Psalm 119) gains 0.13.
WINDOW = 8
WINDOW_MARGIN = 0.25


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


def _module_error(sword_dir: Path, module: str, problem: str, detail: str) -> BibleCorpusError:
    package = MODULE_PACKAGES.get(module, "the package that provides it")
    return BibleCorpusError(
        f"SWORD module '{module}' {problem} under {sword_dir} ({detail}): run apt-get install {package} "
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
        detail = "no mods.d/ there" if sword_dir.is_dir() else "the directory does not exist"
        raise _module_error(sword_dir, module, "not found", detail)
    modules = SwordModules(str(sword_dir))
    found = modules.parse_modules()
    if module not in found:
        raise _module_error(
            sword_dir, module, "not found", f"installed: {', '.join(sorted(found)) or 'none'}"
        )
    try:
        bible = modules.get_bible_from_module(module)
    except (OSError, ValueError, KeyError) as err:
        raise _module_error(sword_dir, module, "is unreadable", str(err)) from err
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
    return {
        "module": module,
        "package": MODULE_PACKAGES.get(module, ""),
        **{key: conf.get(key, "") for key in keys},
    }


def book_order(bible) -> list[tuple[str, list[int]]]:
    """(OSIS id, verses per chapter) for every book of the module's versification, in canon order."""
    books = bible.get_structure().get_books()
    return [
        (book.osis_name, list(book.chapter_lengths))
        for testament in ("ot", "nt")
        for book in books.get(testament, [])
    ]


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
                raise BibleCorpusError(
                    f"{book} {chapter}: expected {length} verses, pysword returned "
                    f"{len(texts)}; is the installed pysword >= 0.2.8?"
                )
            for verse, text in enumerate(texts, start=1):
                verses[VerseRef(book, chapter, verse)] = text or ""
    return verses


# --------------------------------------------------------------------------------------------
# Cleaning


def _log_ratio(spanish: str, english: str) -> float:
    return math.log(len(spanish) / len(english))


def _misfits(spanish: list[str], english: list[str], offset: int, centre: float) -> list[float | None]:
    """Per verse of one book: |log length ratio - centre| of Spanish verse i against English verse
    i + offset (which may lie in the neighbouring chapter, where moved text lands); None where
    either side is empty or outside the book."""
    shifted = [english[i + offset] if 0 <= i + offset < len(english) else "" for i in range(len(spanish))]
    return [
        abs(math.log(len(es) / len(en)) - centre) if es and en else None for es, en in zip(spanish, shifted)
    ]


def _mean_gain(
    same: list[float | None], shifted: list[float | None], positions: Iterable[int]
) -> tuple[float, int]:
    """Mean of same - shifted over the positions where both are known, and how many there were."""
    gains = [a - b for a, b in ((same[i], shifted[i]) for i in positions) if a is not None and b is not None]
    return (sum(gains) / len(gains) if gains else 0.0), len(gains)


def find_misaligned_chapters(es: dict[VerseRef, str], en: dict[VerseRef, str]) -> dict[tuple[str, int], str]:
    """Chapters whose Spanish and English verse numbers do not match, with the reason.

    Args:
        es, en: cleaned text per verse (same keys, in canon order; '' where a module has no text).

    Three rules, each checked against the installed modules by reading the chapters side by side:
    (1) a chapter with an empty Spanish slot where the English has text has Spanish verses merged
    or moved around that slot; (2) the chapter after such a slot is shifted when pairing its
    Spanish verses with English verses k positions away (0 < |k| <= MAX_SHIFT) fits the length
    ratio better than the same numbers by more than SHIFT_MARGIN; (3) any chapter where WINDOW
    consecutive verses fit an offset of one verse better by more than WINDOW_MARGIN is renumbered
    locally. Returns {(book, chapter): reason}, in canon order.
    """
    book_refs: dict[str, list[VerseRef]] = defaultdict(list)
    for ref in es:
        book_refs[ref.book].append(ref)
    ratios = [_log_ratio(es[ref], en[ref]) for ref in es if es[ref] and en[ref]]
    centre = statistics.median(ratios) if ratios else 0.0
    misaligned: dict[tuple[str, int], str] = {}
    for book, refs in book_refs.items():
        spanish, english = [es[ref] for ref in refs], [en[ref] for ref in refs]
        positions: dict[int, list[int]] = defaultdict(list)
        for i, ref in enumerate(refs):
            positions[ref.chapter].append(i)
        same = _misfits(spanish, english, 0, centre)
        shifted = {k: _misfits(spanish, english, k, centre) for k in (-1, 1)}  # more offsets when needed
        for chapter, chapter_positions in positions.items():
            empty = [refs[i].verse for i in chapter_positions if not spanish[i] and english[i]]
            if empty:  # rule 1, then rule 2 for the next chapter
                slots = ", ".join(str(v) for v in empty)
                misaligned[(book, chapter)] = (
                    f"Spanish verse(s) {slots} empty: neighbouring verses merged or moved"
                )
                following = positions.get(chapter + 1, [])
                for k in range(-MAX_SHIFT, MAX_SHIFT + 1):
                    if k and k not in shifted:
                        shifted[k] = _misfits(spanish, english, k, centre)
                (gain, known), k = max((_mean_gain(same, shifted[k], following), k) for k in sorted(shifted))
                if known >= 3 and gain > SHIFT_MARGIN:
                    misaligned.setdefault(
                        (book, chapter + 1),
                        f"Spanish verses match the English ones {k:+d} verse(s) away after the empty slot(s) "
                        f"in chapter {chapter} (length fit better by {gain:.2f})",
                    )
            windows = [chapter_positions[s : s + WINDOW] for s in range(len(chapter_positions) - WINDOW + 1)]
            scored = [(_mean_gain(same, shifted[k], w), k, w) for w in windows for k in (-1, 1)]
            scored = [(gain, k, w) for (gain, known), k, w in scored if known >= WINDOW - 1]
            if scored and (book, chapter) not in misaligned:  # rule 3
                gain, k, window = max(scored)
                if gain > WINDOW_MARGIN:
                    misaligned[(book, chapter)] = (
                        f"Spanish verses {refs[window[0]].verse}-{refs[window[-1]].verse} match the English "
                        f"ones {k:+d} verse away (length fit better by {gain:.2f})"
                    )
    book_index = {book: i for i, book in enumerate(book_refs)}
    return {key: misaligned[key] for key in sorted(misaligned, key=lambda k: (book_index[k[0]], k[1]))}


# --------------------------------------------------------------------------------------------
# Building


def split_of(book: str) -> str:
    """The split a book belongs to: whole books go to dev or test, the rest to train."""
    if book in DEV_BOOKS:
        return "dev"
    if book in TEST_BOOKS:
        return "test"
    return "train"


def extract_pairs(sword_dir: Path = DEFAULT_SWORD_DIR) -> tuple[list[tuple[VerseRef, str, str]], dict]:
    """Read both modules and return aligned (ref, spanish, english) pairs plus a report.

    Args:
        sword_dir: SWORD library root.

    The report holds the dropped chapters with reasons and counts of skipped empty verses.
    """
    sword_dir = Path(sword_dir)
    spanish_bible = open_module(sword_dir, SPANISH_MODULE)
    english_bible = open_module(sword_dir, ENGLISH_MODULE)
    canon = book_order(spanish_bible)  # KJV: the scheme both texts are compared in
    book_ids = [book for book, _ in canon]
    es = {ref: clean_osis(text) for ref, text in read_verses(spanish_bible, book_ids).items()}
    en_all = {ref: clean_osis(text) for ref, text in read_verses(english_bible, book_ids).items()}
    # The WEB uses NRSVA numbering, which has two slots more than KJV (3John 1:15, Rev 12:18);
    # the module leaves them empty. Text there would have no Spanish partner: say so, don't lose it quietly.
    extra = [str(ref) for ref, text in en_all.items() if text and ref not in es]
    en = {ref: en_all.get(ref, "") for ref in es}
    proper = proper_nouns(es.values())
    es = {ref: sentence_case_opening(text, proper) if ref.verse == 1 else text for ref, text in es.items()}
    last_verses = {ref.book: ref for ref in es}  # canon order: the last one seen per book wins
    for ref in last_verses.values():
        es[ref] = drop_subscription(es[ref], en[ref])

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
        "dropped_chapters": [
            {"chapter": f"{book} {chapter}", "verses": verses_per_chapter[(book, chapter)], "reason": reason}
            for (book, chapter), reason in dropped.items()
        ],
        "skipped_verses": {**skipped, "english_empty_refs": english_omissions, "english_only_refs": extra},
    }
    return pairs, report


def _write_atomically(out_dir: Path, files: dict[str, str]) -> None:
    """Write all files into a fresh hidden directory inside out_dir, then os.replace each into place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".bible-", dir=out_dir))
    try:
        for name, content in files.items():
            (staging / name).write_text(content, encoding="utf-8", newline="\n")
        for name in files:
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_bible_corpus(out_dir: Path, sword_dir: Path = DEFAULT_SWORD_DIR) -> dict[str, int]:
    """Build DIR/{train,dev,test}.{es,en} and DIR/split.json from the installed SWORD modules.

    Args:
        out_dir: output directory (created if missing; existing corpus files are replaced).
        sword_dir: SWORD library root holding the spaRV1909eb and engWEB2015eb modules.

    Returns the number of verse pairs per split, e.g. {"train": 27000, "dev": 1100, "test": 2000}.
    Raises BibleCorpusError with the fix when the modules are missing or the output not writable.
    """
    out_dir = Path(out_dir)
    pairs, report = extract_pairs(Path(sword_dir))
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
        "sources": {
            "es": module_info(Path(sword_dir), SPANISH_MODULE),
            "en": module_info(Path(sword_dir), ENGLISH_MODULE),
        },
        "verse_scheme": "KJV (the Spanish module's); verses empty on either side are skipped",
        "counts": counts,
        "books": books_in,
        **report,
        "sha256": {name: hashlib.sha256(text.encode("utf-8")).hexdigest() for name, text in files.items()},
    }
    files["split.json"] = json.dumps(split_info, ensure_ascii=False, indent=2) + "\n"
    try:
        _write_atomically(out_dir, files)
    except OSError as err:
        raise BibleCorpusError(
            f"cannot write the corpus to {out_dir}: {err.strerror or err}; "
            f"choose a writable directory with --out"
        ) from err
    return counts
