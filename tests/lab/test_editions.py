"""The two editions of the book: one code, two languages.

The Japanese chapters' code cells must be the English ones but for the `book.set_language` line;
every sentence a cell writes through `wording.say` must exist in both languages with the same
placeholders; every page links to the same page in the other edition; the Japanese pages carry
no English paragraph.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from maskrcnn_tut.lab import wording

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))
LANGUAGE_LINE = 'book.set_language("{}")'
JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
_spec = importlib.util.spec_from_file_location("edition", ROOT / "tools" / "edition.py")
edition = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(edition)


def read(path: Path):
    return nbformat.read(path, as_version=4)


def test_every_chapter_has_a_japanese_edition_in_the_table_of_contents():
    toc = (ROOT / "_toc.yml").read_text(encoding="utf-8")
    assert CHAPTERS
    for chapter in CHAPTERS:
        assert (BOOK / "ja" / chapter.name).exists(), chapter.name
        assert f"book/ja/{chapter.stem}" in toc and f"book/{chapter.stem}" in toc


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem[:2])
def test_the_japanese_code_cells_are_the_english_ones_but_for_the_language(chapter):
    en, ja = read(chapter), read(BOOK / "ja" / chapter.name)
    assert [c.cell_type for c in en.cells] == [c.cell_type for c in ja.cells]
    english = [c for c in en.cells if c.cell_type == "code"]
    japanese = [c for c in ja.cells if c.cell_type == "code"]
    assert sum(LANGUAGE_LINE.format("en") in c.source for c in english) == 1
    for a, b in zip(english, japanese):
        assert b.source.replace(LANGUAGE_LINE.format("ja"), LANGUAGE_LINE.format("en")) == a.source
        assert a.metadata.get("tags", []) == b.metadata.get("tags", [])


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem[:2])
def test_each_japanese_paragraph_translates_the_english_as_it_reads_now(chapter):
    en, ja = read(chapter), read(BOOK / "ja" / chapter.name)
    behind = [i for i, (a, b) in enumerate(zip(en.cells, ja.cells)) if a.cell_type == "markdown"
              and b.metadata.get(edition.TRANSLATES) != edition.english_hash(a.source)]
    assert not behind, (f"the English of cells {behind} changed since their Japanese was written: translate them, "
                        f"then `python tools/edition.py translated book/ja/{chapter.name} {' '.join(map(str, behind))}`")


def test_an_english_edit_leaves_its_translation_behind(tmp_path, monkeypatch):
    """What the test above reads: sync keeps the hash a translation recorded, so an English edit shows."""
    english, japanese = CHAPTERS[0], BOOK / "ja" / CHAPTERS[0].name
    monkeypatch.setattr(edition, "BOOK", tmp_path)
    monkeypatch.setattr(edition, "JA", tmp_path / "ja")
    (tmp_path / "ja").mkdir()
    en = read(english)
    at = next(i for i, cell in enumerate(en.cells) if i and cell.cell_type == "markdown")
    nbformat.write(read(japanese), tmp_path / "ja" / english.name)
    nbformat.write(en, tmp_path / english.name)
    edition.sync(tmp_path / english.name)  # the translation as it stands records the English it translates
    en.cells[at].source += "\n\nA sentence added in English."
    nbformat.write(en, tmp_path / english.name)
    edition.sync(tmp_path / english.name)
    synced = read(tmp_path / "ja" / english.name).cells[at]
    assert synced.metadata[edition.TRANSLATES] != edition.english_hash(en.cells[at].source)
    edition.mark_translated(tmp_path / "ja" / english.name, [at])
    assert read(tmp_path / "ja" / english.name).cells[at].metadata[edition.TRANSLATES] == edition.english_hash(
        en.cells[at].source)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem[:2])
def test_each_page_links_to_the_other_edition(chapter):
    en, ja = read(chapter), read(BOOK / "ja" / chapter.name)
    assert f"](ja/{chapter.name})" in en.cells[0].source
    assert f"](../{chapter.name})" in ja.cells[0].source


def english_paragraphs(markdown: str) -> list[str]:
    """Lines of a Japanese page that read as English prose: eight or more English words in a row
    once code, links' targets, math and directives are taken out."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith((":", "|", "(")):
            continue
        line = re.sub(r"`[^`]*`|\]\([^)]*\)|\$[^$]*\$|\{[a-z:]+\}", " ", line)
        if re.search(r"(?:\b[A-Za-z][a-z'’-]*[,.;:]?\s+){8,}", line) and not JAPANESE.search(line):
            found.append(line.strip())
    return found


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem[:2])
def test_the_japanese_pages_are_japanese(chapter):
    ja = read(BOOK / "ja" / chapter.name)
    markdown = [c.source for c in ja.cells if c.cell_type == "markdown"]
    assert all(JAPANESE.search(source) for source in markdown if source.strip())
    assert [line for source in markdown for line in english_paragraphs(source)] == []


def say_calls(chapter: Path) -> list[tuple[str, set[str]]]:
    """(key, keyword names) of every `wording.say("key", ...)` call in a chapter's code cells."""
    calls = []
    for cell in read(chapter).cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "say":
                keys = constants(node.args[0])
                names = {k.arg for k in node.keywords}
                assert keys and None not in names, f"{chapter.name}: {ast.unparse(node)[:80]} cannot be checked"
                calls += [(key, names) for key in keys]
    return calls


def constants(node) -> list[str]:
    """The keys a say() call's first argument can take: a string, or `"a" if c else "b"`."""
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return constants(node.body) + constants(node.orelse)
    return []


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem[:2])
def test_every_sentence_a_chapter_says_exists_in_both_languages(chapter):
    name = f"ch{chapter.name[:2]}"
    calls = say_calls(chapter)
    for key, names in calls:
        prefix, _, entry = key.partition(".")
        texts = wording.catalog(prefix)[entry]
        assert set(texts) == set(wording.LANGUAGES), key
        assert wording.placeholders(texts["en"]) == wording.placeholders(texts["ja"]) == names, key
    if name in wording.catalog_names():
        used = {key.partition(".")[2] for key, _ in calls if key.startswith(name + ".")}
        assert set(wording.catalog(name)) == used, "entries no cell says"
