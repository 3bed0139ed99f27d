"""The Japanese edition's glossary (book/ja/glossary.md) is the one rendering of each of its terms.

The glossary's tables give, for each English term, the rendering the Japanese edition uses, the article's
own words, and the renderings it does not use. Every Japanese text of the book is read: the Japanese
chapters' markdown, their catalogs (book/ja/prose), the Japanese side of the lab's
catalogs and of terms.json, the verdict words (`wording.MESSAGES["ja"]`) and the other Japanese pages. None
may hold a rendering the glossary rules out, outside code and quotations of the article (「…」 holding one of
the article's words). The typography the glossary sets (colons,
italics, counters) is checked on the same texts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from maskrcnn_tut.lab import wording

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "book" / "ja" / "glossary.md"
JAPANESE_CHAR = "\u3040-\u30fa\u30fc-\u30ff\u4e00-\u9fff"  # kana and kanji, not the middle dot ・
NONE = {"", "—", "-"}


def glossary() -> list[dict]:
    """The rows of every glossary table that has a 「使わない表記」 column: English, the book's rendering,
    the article's words and the renderings ruled out (lists split at 「、」)."""
    rows, header = [], None
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            row = dict(zip(header, cells))
            if "使わない表記" in row:
                rows.append({"english": row["English"], "term": row["本書の表記"],
                             "article": split(row["元記事の表記"]), "avoid": split(row["使わない表記"])})
    return rows


def split(cell: str) -> list[str]:
    return [] if cell in NONE else [part.strip().strip("`") for part in cell.split("、") if part.strip() not in NONE]


def japanese_texts() -> list[tuple[str, str]]:
    """(where, text) for every Japanese text of the book but the glossary. The chapters' outputs are written
    from the catalogs read here (what else they print is checked on the built pages, test_built_ja.py)."""
    found = []
    for path in sorted((ROOT / "book" / "ja").glob("[0-9][0-9]_*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "markdown":
                found.append((f"{path.stem[:2]}[{i}]", cell.source))
    for path in sorted((ROOT / "book" / "ja").glob("*.md")):
        if path != GLOSSARY:
            found.append((path.name, path.read_text(encoding="utf-8")))
    for path in sorted((ROOT / "book" / "ja" / "prose").glob("*.json")):
        found += [(f"{path.stem}.{key}", value) for key, value in json.loads(path.read_text(encoding="utf-8")).items()]
    for name in wording.catalog_names():
        if (ROOT / "book" / "prose" / f"{name}.json").exists():
            continue
        entries = wording.catalog(name)
        found += [(f"{name}[{key}]" if name == "terms" else f"{name}.{key}",
                   value if name == "terms" else value["ja"]) for key, value in entries.items()]
    found += [(f"MESSAGES[ja][{key}]", value) for key, value in wording.MESSAGES["ja"].items()]
    return found


ARTICLE_WORDS = sorted({word for row in glossary() for word in row["article"]}, key=len, reverse=True)


def prose(text: str) -> str:
    """`text` without code (but with the prose of MyST directives: admonitions, answers), placeholders, link
    targets, URLs, English quotations (lines opened by `>`) and quotations of the article (「…」 holding one
    of the article's words), so what is left is the book's own Japanese. Each removed span becomes a space,
    so words on its two sides do not join."""
    text = re.sub(r"(```|~~~)(?!\{).*?\1", " ", text, flags=re.S)  # code blocks; a ```{directive} is prose
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\{[^{}\n]*\}", " ", text)
    text = re.sub(r"\]\([^)]*\)|https?://\S+", " ", text)
    text = re.sub(r"^\s*>.*$", " ", text, flags=re.M)
    return re.sub(r"「[^「」]*」", lambda m: " " if any(w in m.group() for w in ARTICLE_WORDS) else m.group(), text)


def occurrences(word: str, text: str) -> list[int]:
    """Where `word` starts in `text`: an ASCII word only as a whole word outside code-like names
    (`loss.backward()`, `forward_ms`, 'backward'), anything else as a substring."""
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9 _-]*", word):
        pattern = rf"(?<![\w./'-]){re.escape(word)}(?![\w(/'-])"
        return [m.start() for m in re.finditer(pattern, text, flags=re.I)]
    return [m.start() for m in re.finditer(re.escape(word), text)]


def ruled_out(row: dict, text: str) -> list[str]:
    """The ruled-out renderings of `row` in `text`, but those inside the book's own rendering
    (ワーカ inside ワーカー when ワーカー is the book's)."""
    kept = [(start, start + len(row["term"])) for start in occurrences(row["term"], text)]
    found = []
    for word in row["avoid"]:
        for start in occurrences(word, text):
            if not any(a <= start and start + len(word) <= b for a, b in kept):
                found.append(text[max(0, start - 12):start + len(word) + 12].replace("\n", " "))
    return found


def test_the_glossary_has_the_articles_vocabulary_first_and_one_rendering_per_term():
    rows = glossary()
    english = [row["english"] for row in rows]
    assert english[:6] == ["distributed training", "training", "gradient accumulation", "mixed precision (AMP)",
                           "DataLoader", "worker"]
    assert len(set(english)) == len(english)
    for row in rows:
        assert row["term"] and "、" not in row["term"], row  # one rendering (速い／遅い: one for each word)
        assert row["term"] not in row["avoid"], row
    named = {row["english"]: row["term"] for row in rows}
    assert named["forward (pass)"] == "順伝播" and named["backward (pass)"] == "逆伝播"
    assert named["within noise"] in wording.MESSAGES["ja"][wording.WITHIN_NOISE]


@pytest.mark.parametrize("row", glossary(), ids=lambda row: row["english"])
def test_only_the_glossarys_rendering_is_used(row):
    found = [(where, context) for where, text in japanese_texts() for context in ruled_out(row, prose(text))]
    assert not found, f"{row['english']}: write {row['term']}, not " + "; ".join(f"{w}: …{c}…" for w, c in found)


def test_every_rendering_is_used_somewhere():
    texts = "\n".join(prose(text) for _, text in japanese_texts())
    unused = [row["term"] for row in glossary() if not all(occurrences(part, texts) for part in row["term"].split("／"))]
    assert not unused


def test_the_glossary_is_a_page_of_the_japanese_part():
    toc = (ROOT / "_toc.yml").read_text(encoding="utf-8")
    japanese_part = toc.split("caption: 日本語版", 1)[1]
    assert "file: book/ja/glossary" in japanese_part
    preface = nbformat.read(ROOT / "book" / "ja" / "00_preface.ipynb", as_version=4)
    assert "](glossary.md)" in "".join(cell.source for cell in preface.cells if cell.cell_type == "markdown")


# --------------------------------------------------------------------------- typography (glossary's 表記の約束)

JA = f"[{JAPANESE_CHAR}（）「」、。]"
RULES = {
    "ASCII colon beside Japanese (write ：)": re.compile(rf"(?<={JA}):|(?<!:):(?!:)(?=[ \t]*[{JAPANESE_CHAR}])"),
    "ASCII parenthesis around Japanese (write （）)": re.compile(rf"\((?=[^()\n]*[{JAPANESE_CHAR}][^()\n]*\))"),
    "italic Japanese (write ** or 「」)": re.compile(rf"(?<!\*)\*(?!\*|\s)[^*\n]*[{JAPANESE_CHAR}][^*\n]*(?<![*\s])\*(?!\*)"),
    "a number joined to its counter (write 8 枚)": re.compile(
        rf"(?<![第\d.,A-Za-z_])\d+(?:[.,]\d+)?(?=[{JAPANESE_CHAR}])(?![年月日時])"),
    "GPUs counted with 基 (write 枚)": re.compile(r"\d\s*基"),
    "images counted as 画像 (write 枚)": re.compile(r"\d\s*画像(?!サイズ)"),
    "x for times beside Japanese (write 倍)": re.compile(rf"\d\.\d+x(?=\s*[{JAPANESE_CHAR}（、。])"),  # not Detectron2's 1x
    "a space before % (write 90%)": re.compile(r"\d %"),
}
#: The same rules where a template's placeholder stands for the number.
TEMPLATE_RULES = {
    "a number joined to its counter (write 8 枚)": re.compile(r"\}(?=[倍枚個回台つ件種秒])"),
    "a space before % (write 90%)": re.compile(r"\} %"),
    "x for times beside Japanese (write 倍)": re.compile(rf"\}}x(?=\s*[{JAPANESE_CHAR}（、。])"),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.split(" (")[0])
def test_the_typography_rules(rule):
    found = []
    for where, text in japanese_texts():
        own = prose(text)
        found += [f"{where}: …{own[max(0, m.start() - 15):m.end() + 15]}…".replace("\n", " ")
                  for m in RULES[rule].finditer(own)]
        if rule in TEMPLATE_RULES:
            found += [f"{where}: …{text[max(0, m.start() - 15):m.end() + 15]}…".replace("\n", " ")
                      for m in TEMPLATE_RULES[rule].finditer(text)]
    assert not found, f"{len(found)} × {rule}:\n" + "\n".join(found)


def test_lr_scaling_is_on_by_default_in_chapter_10():
    """Japanese review #1: --lr is scaled unless --lr-scaling none, not only when the flag is given."""
    summary = nbformat.read(ROOT / "book" / "ja" / "10_summary.ipynb", as_version=4)
    text = "".join(cell.source for cell in summary.cells if cell.cell_type == "markdown")
    assert "`--lr-scaling` を付けると" not in text
    assert "既定の `--lr-scaling auto`" in text and "`--lr-scaling none`" in text
