"""Keep the Japanese edition's chapters in step with the English ones.

    python tools/edition.py sync [book/04_dataparallel_vs_ddp.ipynb ...]
    python tools/edition.py translated book/ja/04_dataparallel_vs_ddp.ipynb 19 [20 ...]

For each English chapter `book/NN_name.ipynb`, `book/ja/NN_name.ipynb` gets the English code cells
(tags and all) with the one line that differs, `book.set_language("ja")`, and keeps its own Japanese
markdown cells and the outputs of its code cells that did not change (nbval's reference outputs come
from a Japanese run: `python tools/nb.py --execute book/ja/NN_name.ipynb`). A chapter with no
Japanese file yet is created with the English markdown, to be translated. Both editions' first
markdown cell gets the link to the other edition under its title. The cells must line up (markdown
where markdown, code where code); where an English edit added or removed a cell, sync stops and says
which, so the translation is edited by hand first.

Each Japanese markdown cell records, in its metadata, a hash of the English cell it translates
(`translates`): an English edit to a markdown cell leaves that hash behind, and a test names the cell.
Once it is translated again, `translated` records the English as it now reads.
tests/lab/test_editions.py checks what sync makes. Not part of the installed package (it needs nbformat).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import nbformat

BOOK = Path(__file__).resolve().parents[1] / "book"
JA = BOOK / "ja"
LANGUAGE_LINE = 'book.set_language("{lang}")'
LINKS = {"en": "*[日本語版](ja/{name})*", "ja": "*[English edition](../{name})*"}
LINK_LINE = re.compile(r"^\*\[(日本語版|English edition)\]\([^)]*\)\*$", re.M)
TRANSLATES = "translates"


def english_hash(source: str) -> str:
    """What a Japanese markdown cell records of the English cell it translates (the link line left out)."""
    return hashlib.sha1(LINK_LINE.sub("", source).strip().encode()).hexdigest()[:12]


def japanese_code(source: str) -> str:
    """An English code cell as the Japanese chapter has it."""
    return source.replace(LANGUAGE_LINE.format(lang="en"), LANGUAGE_LINE.format(lang="ja"))


def with_link(source: str, lang: str, name: str) -> str:
    """The first markdown cell with the other edition's link as the line after its title."""
    source = LINK_LINE.sub("", source).replace("\n\n\n", "\n\n")
    title, _, rest = source.partition("\n")
    return f"{title}\n\n{LINKS[lang].format(name=name)}\n" + ("\n" + rest.lstrip("\n") if rest.strip() else "")


def sync(english: Path) -> Path:
    en = nbformat.read(english, as_version=4)
    target = JA / english.name
    ja = nbformat.read(target, as_version=4) if target.exists() else None
    if ja is not None:
        kinds = ([c.cell_type for c in en.cells], [c.cell_type for c in ja.cells])
        if kinds[0] != kinds[1]:
            at = next((i for i, (a, b) in enumerate(zip(*kinds)) if a != b), min(map(len, kinds)))
            raise SystemExit(f"{target}: its cells no longer line up with {english.name} from cell {at}; "
                             "add or remove the Japanese cell there first")
    if LANGUAGE_LINE.format(lang="en") not in "".join(c.source for c in en.cells if c.cell_type == "code"):
        raise SystemExit(f"{english}: no code cell calls {LANGUAGE_LINE.format(lang='en')}")
    cells = []
    for i, cell in enumerate(en.cells):
        new = nbformat.from_dict(dict(cell))
        if cell.cell_type == "code":
            new.source = japanese_code(cell.source)
            if ja is not None and ja.cells[i].source == new.source:  # unchanged: keep the Japanese run's outputs
                new.outputs = ja.cells[i].outputs
        elif ja is not None:  # a cell synced before its hash was kept records the English of today
            new.source = ja.cells[i].source
            new.metadata[TRANSLATES] = ja.cells[i].metadata.get(TRANSLATES, english_hash(cell.source))
        cells.append(new)
    en.cells[0].source = with_link(en.cells[0].source, "en", english.name)
    cells[0].source = with_link(cells[0].source, "ja", english.name)
    nbformat.write(en, english)
    out = nbformat.v4.new_notebook(cells=cells, metadata=dict(en.metadata))
    JA.mkdir(exist_ok=True)
    nbformat.write(out, target)
    return target


def mark_translated(japanese: Path, cells: list[int]) -> None:
    """Record that the Japanese markdown `cells` translate their English cells as these read now."""
    en, ja = (nbformat.read(path, as_version=4) for path in (BOOK / japanese.name, japanese))
    for i in cells:
        if ja.cells[i].cell_type != "markdown":
            raise SystemExit(f"{japanese}: cell {i} is a code cell; sync copies those")
        ja.cells[i].metadata[TRANSLATES] = english_hash(en.cells[i].source)
    nbformat.write(ja, japanese)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("sync").add_argument("chapters", nargs="*", type=Path, help="English chapters (default: all)")
    translated = commands.add_parser("translated")
    translated.add_argument("chapter", type=Path, help="a Japanese chapter")
    translated.add_argument("cells", nargs="+", type=int, help="its markdown cells now translated (0-based)")
    args = parser.parse_args(argv)
    if args.command == "translated":
        mark_translated(args.chapter, args.cells)
        return 0
    for english in args.chapters or sorted(BOOK.glob("[0-9][0-9]_*.ipynb")):
        print(sync(english))
    return 0


if __name__ == "__main__":
    sys.exit(main())
