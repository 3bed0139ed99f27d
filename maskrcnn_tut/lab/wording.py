"""Plain words for what a comparison of two measurements found: faster, slower or within noise.

Every chapter says it through this module, so "within noise" means the same thing everywhere and
is explained in one place, chapter 3, where the book first compares two measured settings: a
setting is faster or slower only when the middle halves of the two settings' steps do not overlap,
and within noise when they do. Elsewhere the words are the verdict alone ("faster than fp32"),
without restating that rule. The verdict is a code (`FASTER`, `SLOWER`, `WITHIN_NOISE`,
`NO_SPREAD`); its words come from `MESSAGES[lang]`, so an edition of the book in another language
adds a table there and keeps every verdict.

- `compare(a, b)`: two measured rows with their spreads (`bench.versus`: whole ranges apart or not).
- `compare_to(row, value)`: a measured row's range against a fixed figure (`bench.above`).
- `compare_figures(a, b, noise)`: two figures without spreads, within noise below a relative threshold.
- `words(verdict, than)`, `times(ratio)`, `pick(verdict, ...)`: the phrase, "1.23 times", and one
  template per verdict for sentences a chapter words its own way.

The book has two editions, English and Japanese, whose code cells are the same but for one
`set_language` call. Every sentence a cell writes comes from `say(key, **values)` in the book's
language: a lab module's sentences are the entries of `prose/<module>.json` (key `"<module>.<entry>"`,
both languages in one file), a chapter's own are beside the chapters, `book/prose/chNN.json` and
`book/ja/prose/chNN.json` (key `"chNN.<entry>"`). Keys are written whole where they are used, so a
grep finds every use (tests/lab/test_catalog_keys.py). Table headers, plot labels and short values go
through `term`, which looks them up in `prose/terms.json`.

What is recorded (a results file, the bench cache, the shell) keeps a sentence as data: `english(key,
**values)` makes a `Said`, a string that reads as its English and carries its key and values;
`to_json`/`from_json` store and restore it, and `shown` words it again in the book's language.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import string
import threading
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = ("en", "ja")
PROSE_DIR = Path(__file__).with_name("prose")
#: Each chapter's own sentences, beside the chapters (a checkout's `book/`): one file per chapter and language.
CHAPTER_PROSE = {"en": Path(__file__).resolve().parents[2] / "book" / "prose",
                 "ja": Path(__file__).resolve().parents[2] / "book" / "ja" / "prose"}
_current = {"lang": "en"}
_this_thread = threading.local()  # a `speaking` block's language, for its thread only

FASTER, SLOWER, WITHIN_NOISE, NO_SPREAD = "faster", "slower", "within noise", "no spread"
#: The steady-state bench's fourth answer (`bench.steady.verdict`): the interval or the rounds disagree.
INCONCLUSIVE = "inconclusive"
VERDICTS = (FASTER, SLOWER, WITHIN_NOISE, NO_SPREAD, INCONCLUSIVE)
_ORDER = {1: FASTER, -1: SLOWER, 0: WITHIN_NOISE, None: NO_SPREAD}

#: The words of each verdict, by language: the verdict, plainly; "noise" is the one clause a
#: sentence adds where it must say why it found no difference.
MESSAGES = {
    "en": {
        FASTER: "faster{than}",
        SLOWER: "slower{than}",
        WITHIN_NOISE: "within noise{of}",
        NO_SPREAD: "no spread recorded",
        INCONCLUSIVE: "inconclusive{versus}",
        "than": " than {name}",
        "of": " of {name}",
        "versus": " against {name}",
        "noise": "the ranges overlap",
        "times": "{ratio:.2f} times",
        "x": "x",
        "named": "{name}: {text}",
    },
    # Japanese: "within noise of X" is 「X との差がばらつきの範囲内」 (the glossary's rendering, book/ja/glossary.md),
    # a clause that reads alone and after a topic (「固定サイズは…」); a space between a name and the kana after it
    "ja": {
        FASTER: "{than}速い",
        SLOWER: "{than}遅い",
        WITHIN_NOISE: "{of}ばらつきの範囲内",
        NO_SPREAD: "ばらつきの記録なし",
        INCONCLUSIVE: "{versus}結論が出ない",
        "than": "{name} より",
        "of": "{name} との差が",
        "versus": "{name} との比較では",
        "noise": "範囲が重なっています",
        "times": "{ratio:.2f} 倍",
        "x": " 倍",
        "named": "{name}：{text}",
    },
}


def set_language(lang: str) -> None:
    """The language every later `say`, `term` and verdict is worded in ("en" or "ja")."""
    if lang not in LANGUAGES:
        raise ValueError(f"unknown language {lang!r}: the book has {', '.join(LANGUAGES)}")
    _current["lang"] = lang


def language() -> str:
    return getattr(_this_thread, "lang", None) or _current["lang"]


@contextlib.contextmanager
def speaking(lang: str):
    """Inside the block this thread words everything in `lang` (what is recorded, in English, say);
    the book's language and other threads' are untouched."""
    before = getattr(_this_thread, "lang", None)
    _this_thread.lang = lang
    try:
        yield
    finally:
        _this_thread.lang = before


def catalog_names() -> list[str]:
    """Every catalog: the lab modules' (`prose/<module>.json`) and the chapters' (`book/prose/chNN.json`)."""
    return sorted(path.stem for folder in (PROSE_DIR, CHAPTER_PROSE["en"]) for path in folder.glob("*.json"))


@functools.cache
def catalog(name: str) -> dict:
    """The entries of a catalog, each {"en": template, "ja": template} (terms.json: English to Japanese): a lab
    module's `prose/<name>.json` holds both languages, a chapter's one file per language beside the chapters.
    An entry the core words in English itself names it, `"en_from": "module.CONSTANT"`, so the sentence exists once."""
    if (CHAPTER_PROSE["en"] / f"{name}.json").exists():
        texts = {lang: json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
                 for lang, folder in CHAPTER_PROSE.items()}
        return {entry: {lang: texts[lang].get(entry) for lang in LANGUAGES} for entry in texts["en"]}
    entries = json.loads((PROSE_DIR / f"{name}.json").read_text(encoding="utf-8"))
    for entry in entries.values():
        if isinstance(entry, dict) and "en_from" in entry:
            module, _, constant = entry.pop("en_from").rpartition(".")
            entry["en"] = getattr(importlib.import_module(module), constant)
    return entries


def say(key: str, **values) -> str:
    """The text of `key` ("ch04.scatter_all": entry "scatter_all" of book/prose/ch04.json) in the book's language,
    its `{placeholders}` filled from `values` with `str.format`; a recorded sentence among them (a `Said`, say a
    finding measured in the other edition's run and read back) is worded in the book's language too."""
    name, _, entry = key.partition(".")
    return catalog(name)[entry][language()].format(**{k: shown(v) if isinstance(v, Said) else v
                                                      for k, v in values.items()})


class Said(str):
    """A sentence kept as its catalog key and values: it reads (and prints, and is compared) as its
    English text, which is what a results file or the shell shows, and `shown` words it again in the
    book's language from the key. `english` gives the English where the core wrote it (a warning the
    core words itself, whose catalog entry holds the other languages only)."""

    def __new__(cls, key: str, values: dict | None = None, english: str | None = None):
        values = dict(values or {})
        if english is None:
            name, _, entry = key.partition(".")
            english = catalog(name)[entry]["en"].format(**values)
        said = super().__new__(cls, english)
        said.key, said.values = key, values
        return said

    def __getnewargs__(self):
        return self.key, self.values, str(self)


def english(key: str, /, **values) -> Said:
    """What is recorded of `key` ("bench.table_cpu") with `values`, whatever the book's language."""
    return Said(key, values)


#: The key of recorded sentences said one after the other (`joined`).
JOINED = "joined"


def joined(*parts) -> Said:
    """Recorded sentences (and plain text) one after the other, kept as one value: it reads as the parts'
    English, and `shown` words each part in the book's language."""
    return Said(JOINED, {"parts": list(parts)}, english="".join(str(part) for part in parts))


def shown(value):
    """A recorded value as the book shows it: a `Said` worded in the book's language (its values
    shown in turn), a string through `term`; anything else as it is."""
    if language() == "en":
        return str(value) if isinstance(value, Said) else value
    if isinstance(value, Said):
        if value.key == JOINED:
            return "".join(str(shown(part)) for part in value.values["parts"])
        name, _, entry = value.key.partition(".")
        return catalog(name)[entry][language()].format(**{k: shown(v) for k, v in value.values.items()})
    return term(value) if isinstance(value, str) else value


def shown_rows(rows, columns=None) -> tuple[list[dict], list[str]]:
    """Rows and their columns as the book shows them: headers and text cells through `shown`."""
    columns = list(columns or (rows[0] if rows else ()))
    headers = [shown(column) for column in columns]
    return [{header: shown(row.get(column)) for header, column in zip(headers, columns)} for row in rows], headers


def to_json(value):
    """`value` with every `Said` as {"said": key, "values": ..., "en": text}, for a JSON file."""
    if isinstance(value, Said):
        return {"said": value.key, "values": to_json(value.values), "en": str(value)}
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    return value


def from_json(value):
    """What `to_json` wrote, with its sentences as `Said` again."""
    if isinstance(value, dict):
        if value.keys() == {"said", "values", "en"}:
            return Said(value["said"], from_json(value["values"]), value["en"])
        return {key: from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item) for item in value]
    return value


def term(text: str) -> str:
    """A table header, plot label or short value in the book's language; one without a Japanese
    entry (a flag, a preset's name) stays as it is."""
    return text if language() == "en" else catalog("terms").get(text, text)


def placeholders(template: str) -> set[str]:
    """The names a template fills, e.g. {"devices"} for "{devices} devices" (the tests compare languages by them)."""
    return {field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(template) if field}


def interval(row: dict | None, key: str = "img/s") -> tuple[float, float] | None:
    """(low, high) of a row's `key` ("img/s" or "speedup"), or None when it has no spread."""
    if not row or row.get(f"{key} lo") is None or row.get(f"{key} hi") is None:
        return None
    return float(row[f"{key} lo"]), float(row[f"{key} hi"])


def versus(a: dict | None, b: dict | None, key: str = "img/s") -> int | None:
    """+1 when a's whole range of `key` lies above b's, -1 below, 0 when they overlap (within
    noise); None when either has no spread."""
    ia, ib = interval(a, key), interval(b, key)
    if ia is None or ib is None:
        return None
    return 1 if ia[0] > ib[1] else -1 if ia[1] < ib[0] else 0


def above(row: dict | None, value: float, key: str = "speedup") -> int | None:
    """+1 when the row's whole range of `key` lies above `value`, -1 below, 0 when it contains it."""
    span = interval(row, key)
    if span is None:
        return None
    return 1 if span[0] > value else -1 if span[1] < value else 0


@dataclass(frozen=True)
class Comparison:
    """A measured figure against another: `ratio` is a / b, `verdict` one of `VERDICTS`."""
    ratio: float
    verdict: str

    def words(self, than: str = "", lang: str | None = None, **own: str) -> str:
        return words(self.verdict, than, lang, **own)

    def times(self, lang: str | None = None) -> str:
        return times(self.ratio, lang)


def compare(a: dict, b: dict, key: str = "img/s") -> Comparison:
    """Row a against row b: faster or slower only when their whole ranges of `key` lie apart."""
    return Comparison(a[key] / b[key], _ORDER[versus(a, b, key)])


def compare_to(row: dict, value: float, key: str = "speedup") -> Comparison:
    """A row's range of `key` against a fixed figure: faster (above it), slower, or within noise
    when the range contains it."""
    return Comparison(row[key] / value, _ORDER[above(row, value, key)])


def compare_figures(a: float, b: float, noise: float) -> Comparison:
    """Two figures without spreads: within noise when a differs from b by at most `noise` of b."""
    ratio = a / b
    verdict = WITHIN_NOISE if abs(ratio - 1) <= noise else FASTER if ratio > 1 else SLOWER
    return Comparison(ratio, verdict)


def words(verdict: str, than: str = "", lang: str | None = None, **own: str) -> str:
    """The verdict as a phrase, e.g. "slower than fp32"; `own` words a
    verdict the chapter's way (keyed like `pick`'s templates, e.g. a verdict of its own)."""
    if verdict.replace(" ", "_") in own:
        return pick(verdict, **own)
    table = MESSAGES[lang or language()]
    named = {part: table[part].format(name=than) if than else "" for part in ("than", "of", "versus")}
    return table[verdict].format(**named)


def noise(lang: str | None = None) -> str:
    """What "within noise" means, for sentences that say it in their own words."""
    return MESSAGES[lang or language()]["noise"]


def times(ratio: float, lang: str | None = None) -> str:
    """'1.23 times', the phrasing of a ratio of speeds."""
    return MESSAGES[lang or language()]["times"].format(ratio=ratio)


def pick(verdict: str, **templates: str) -> str:
    """The template for `verdict` among `faster=`, `slower=`, `within_noise=`, `no_spread=`;
    a verdict without a template is an error, so a chapter cannot silently say nothing."""
    name = verdict.replace(" ", "_")
    if name not in templates:
        raise KeyError(f"no template for the verdict {verdict!r} (have: {', '.join(templates)})")
    return templates[name]
