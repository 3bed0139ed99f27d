"""The built Japanese pages (`jupyter-book build .`, `_build/html/book/ja/`) as a Japanese reader gets them:
`<html lang="ja">`, the Japanese book title, Japanese site chrome, and no English sentence outside code,
error messages, quotations and proper names. What a chapter prints when it runs (tables, verdicts, a
results file's labels) is in the page only once it is built, so only the built page shows whether it came
out in Japanese. In the book tier (`pytest -m book`); skipped when the book has not been built.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_glossary_ja import glossary

from maskrcnn_tut.lab import book_language

pytestmark = pytest.mark.book

ROOT = Path(__file__).resolve().parents[2]
BUILT = ROOT / "_build" / "html" / "book" / "ja"
PAGES = sorted(BUILT.glob("*.html")) if BUILT.exists() else []
#: Elements whose text is not the book's Japanese: code (a cell's input, code blocks, inline code), maths,
#: quotations, error output (tracebacks, stderr) and the page's scripts.
SKIPPED_CLASSES = {"cell_input", "highlight-python", "highlight-bash", "highlight-py", "highlight-default",
                   "highlight-ipython3", "highlight-text", "highlight-none", "highlight-yaml", "highlight-shell",
                   "highlight-json", "math", "stderr", "traceback", "error"}
SKIPPED_TAGS = {"script", "style", "code", "kbd", "samp", "blockquote", "head", "svg", "math"}
#: Proper names and quoted titles that are English sentences by nature (a short list; code, flags and
#: quotations in quotation marks need none).
ALLOWED = ("Accurate, Large Minibatch SGD", "A Recipe for Training Neural Networks",
           "Accelerating PyTorch with CUDA Graphs", "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms",
           "Fast distributed Mask R-CNN training in PyTorch", "NVIDIA DGX-1", "Ultra-Scale Playbook",
           "stack expects each tensor to be equal size, but got")  # torch's error, printed by chapter 3
#: Three or more English words in a row (a word may end in , ; or :), two of them lowercase words, make a
#: sentence (or an English label: "training wall time").
SENTENCE = re.compile(r"(?<![\w./-])(?:[A-Za-z][A-Za-z'’-]*[,;:]?[ \t]+){2,}[A-Za-z][A-Za-z'’-]*(?![\w./(-])")
QUOTED = re.compile(r'"[^"\n]*"|[“”][^“”\n]*[“”]|(?<![A-Za-z])\'[^\'\n]*\'(?![A-Za-z])')
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")


#: Tags whose start or end ends a line of text.
BLOCKS = {"p", "li", "td", "th", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "summary", "caption", "div",
          "tr", "table", "section", "details", "figcaption", "ul", "ol", "br"}
#: A cell whose code runs one of the package's programs (train.py's loop, predict, torchrun, processes it
#: launches, the CLI's own help): what it prints is the program's log, English like any program's output.
PROGRAM = re.compile(r"\b(run_command|run_cli|train\.run|launch|build_parser|data\.check|predict_images|weights_report)\b")
#: An error message (an exception's name and text) printed by a cell.
ERROR = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b")


class Text(HTMLParser):
    """A page's lines of text outside the skipped elements and outside the outputs of cells that run a
    program (`PROGRAM`); and its attribute texts (titles, labels, placeholders)."""

    VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "source", "col", "area", "base", "param", "track"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, a cell)
        self.lines: list[tuple[int, str]] = []  # (cell number or -1, text)
        self.attributes: list[str] = []
        self.line, self.cells, self.inputs = [], 0, {}

    def _cell(self) -> int:
        numbers = [i for i, (_, _, cell) in enumerate(self.stack) if cell]
        return self.stack[numbers[-1]][2] if numbers else -1

    def _flush(self):
        text = "".join(self.line).strip()
        if text:
            self.lines.append((self._cell(), text))
        self.line = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.attributes += [value for name, value in attrs.items()
                            if name in ("title", "aria-label", "placeholder", "alt") and value]
        if tag in BLOCKS:
            self._flush()
        if tag in self.VOID:
            return
        classes = set((attrs.get("class") or "").split())
        cell = False
        if tag == "div" and "cell" in classes:
            self.cells += 1
            cell = self.cells
        skipped = tag in SKIPPED_TAGS or bool(classes & SKIPPED_CLASSES)
        if "cell_input" in classes:
            self.inputs.setdefault(self._cell(), [])
        self.stack.append((tag, skipped, cell))

    def handle_endtag(self, tag):
        if tag in BLOCKS:
            self._flush()
        if tag not in self.VOID and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if any(skipped for _, skipped, _ in self.stack):
            if any(tag == "div" for tag, _, _ in self.stack) and self._cell() in self.inputs:
                self.inputs[self._cell()].append(data)
            self.line.append(" ")
            return
        self.line.append(data)

    def texts(self) -> list[str]:
        """The lines the page's reader reads: not a program's output, not an error message."""
        programs = {cell for cell, parts in self.inputs.items() if PROGRAM.search("".join(parts))}
        return [text for cell, text in self.lines if cell not in programs and not ERROR.search(text)]


def read(page: Path) -> Text:
    parser = Text()
    parser.feed(page.read_text(encoding="utf-8"))
    parser.close()
    parser._flush()
    return parser


def english_sentences(text: str) -> list[str]:
    """The English sentences in a Japanese page's text: three or more English words in a row, of which two
    are lowercase words, once quotations in quotation marks and the allowed names are taken out."""
    for name in ALLOWED:
        text = text.replace(name, " ")
    text = QUOTED.sub(" ", text)
    return [m.group() for m in SENTENCE.finditer(text)
            if sum(len(word) > 1 and word.islower() for word in WORD.findall(m.group())) >= 2]


def test_the_sentence_finder_finds_english_and_leaves_code_names_and_quotations():
    assert english_sentences("read with gloo; rank 1's stack:") == ["read with gloo; rank"]
    assert english_sentences("training wall time (under load)") == ["training wall time"]
    assert english_sentences("the 2 cores were shared with 5 other engineers' test runs") != []
    assert english_sentences("DDP の all-reduce と `torch.compile` を Mask R-CNN で") == []
    assert english_sentences('NVML は "percent of time over the past sample period" と定義します') == []
    assert english_sentences("（Goyal et al., 2017, Accurate, Large Minibatch SGD）") == []
    assert english_sentences("NVIDIA の PyTorch Mask R-CNN では") == []  # names, capitalised


@pytest.mark.skipif(not PAGES, reason="the book is not built (jupyter-book build .)")
@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_a_built_japanese_page_is_japanese(page):
    html = page.read_text(encoding="utf-8")
    assert re.search(r'<html[^>]* lang="ja"', html), "lang"
    assert re.search(rf"<title>[^<]*{book_language.TITLE_JA}</title>", html), "title"
    parsed = read(page)
    found = [sentence for text in parsed.texts() for sentence in english_sentences(text)]
    if page.stem == "glossary":  # its English column
        found = [sentence for sentence in found if sentence not in {row["english"] for row in glossary()}]
    assert not found, f"English sentences on {page.name}: {found}"
    chrome = [text for text in parsed.attributes if re.fullmatch(r"(Search|Toggle \w+ sidebar|Download this page|"
                                                                r"Link to this \w+|Main|Color mode)\W*", text)]
    assert not chrome, chrome


@pytest.mark.skipif(not PAGES, reason="the book is not built (jupyter-book build .)")
def test_every_japanese_page_is_built():
    expected = {path.stem for path in (ROOT / "book" / "ja").glob("[0-9][0-9]_*.ipynb")} | {"glossary"}
    assert expected <= {page.stem for page in PAGES}
