"""Stored English, shown in the book's language.

What a benchmark measures is kept in English: its rows, notes and title go into results files and
the cache, and the shell prints them, whichever edition of the book ran it. The book shows them in
its own language at display time. Each English text made from a template of `CATALOGS` (entries
`{"en": ..., "ja": ...}` of `prose/<name>.json`) is made with `english(key, **values)`, and
`shown(text)` reads such a text back: it finds the template whose English matches, reads the
values out of it and fills the template of the current language with them (each value shown in
turn, so a note may quote a label). A text that is a `wording.term` is that term; one that no
template matches either stays as it is (a preset's name, a number, a committed file's sentence that
no template has any more).

"""
from __future__ import annotations

import functools
import re
import string

from .. import wording
from ..wording import term

#: The catalogs whose English is stored and read back (`register_catalog` adds another module's).
CATALOGS = ["bench", "book", "machine", "dataparallel"]
#: Templates with fewer literal characters than this match too much to be read back.
MIN_LITERAL = 3


def register_catalog(name: str) -> None:
    """Read the stored English of `prose/<name>.json` back too (a module that stores its own)."""
    if name not in CATALOGS:
        CATALOGS.append(name)
        _patterns.cache_clear()


def english(key: str, /, **values) -> str:
    """The English text of `key` ("bench.table_cpu"), whatever the book's language: what is stored."""
    name, _, entry = key.partition(".")
    return wording.catalog(name)[entry]["en"].format(**values)


def _plain(template: str) -> str:
    """The template with its fields' format specs and conversions dropped: it is filled with the
    values as they were written in the English text."""
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is not None:
            parts.append("{" + field + "}")
    return "".join(parts)


def _regex(template: str) -> tuple[re.Pattern, int]:
    """A pattern matching what `template` writes, each field a named group; its literal length."""
    pattern, seen, literal = [], set(), 0
    for text, field, _, _ in string.Formatter().parse(template):
        pattern.append(re.escape(text))
        literal += len(text.strip())
        if field is not None:
            pattern.append(f"(?P={field})" if field in seen else f"(?P<{field}>.*?)")
            seen.add(field)
    return re.compile("".join(pattern), re.S), literal


@functools.cache
def _patterns(lang: str) -> list[tuple[re.Pattern, str]]:
    """(English pattern, `lang`'s plain template) of every entry of `CATALOGS`, most literal text first."""
    found = []
    for name in CATALOGS:
        try:
            entries = wording.catalog(name)
        except FileNotFoundError:
            continue
        for entry in entries.values():
            if isinstance(entry, dict) and entry.get("en") and entry.get(lang):
                pattern, literal = _regex(entry["en"])
                if literal >= MIN_LITERAL:
                    found.append((literal, pattern, _plain(entry[lang])))
    return [(pattern, template) for _, pattern, template in sorted(found, key=lambda item: -item[0])]


def shown(text):
    """`text` (stored English) in the book's language; anything not a string comes back as it is."""
    if not isinstance(text, str) or wording.language() == "en" or not text:
        return text
    if term(text) != text:  # a term of its own comes first
        return term(text)
    for pattern, template in _patterns(wording.language()):
        match = pattern.fullmatch(text)
        if match:
            return template.format(**{name: shown(value) for name, value in match.groupdict().items()})
    return term(text)


def shown_rows(rows, columns=None) -> tuple[list[dict], list[str]]:
    """Rows and their columns as the book shows them: headers and text cells through `shown`."""
    columns = list(columns or (rows[0] if rows else ()))
    headers = [shown(column) for column in columns]
    return [{header: shown(row.get(column)) for header, column in zip(headers, columns)} for row in rows], headers
