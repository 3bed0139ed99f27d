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
           "Fast distributed Mask R-CNN training in PyTorch", "NVIDIA DGX-1", "Ultra-Scale Playbook")
#: Three or more English words in a row (a word may end in , ; or :), two of them lowercase words, make a
#: sentence (or an English label: "training wall time").
SENTENCE = re.compile(r"(?<![\w./-])(?:[A-Za-z][A-Za-z'’-]*[,;:]?[ \t]+){2,}[A-Za-z][A-Za-z'’-]*(?![\w./(-])")
QUOTED = re.compile(r'"[^"\n]*"|“[^”\n]*”|(?<![A-Za-z])\'[^\'\n]*\'(?![A-Za-z])')
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")


class Text(HTMLParser):
    """A page's text outside the skipped elements, one entry per text node; and its attribute texts."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[bool] = []
        self.texts: list[str] = []
        self.attributes: list[str] = []

    VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "source", "col", "area", "base", "param", "track"}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.attributes += [value for name, value in attrs.items() if name in ("title", "aria-label", "placeholder", "alt")
                            and value]
        if tag in self.VOID:
            return
        classes = set((attrs.get("class") or "").split())
        self.stack.append(tag in SKIPPED_TAGS or bool(classes & SKIPPED_CLASSES))

    def handle_endtag(self, tag):
        if tag not in self.VOID and self.stack:
            self.stack.pop()

    def handle_data(self, data):
        if not any(self.stack) and data.strip():
            self.texts.append(data)


def read(page: Path) -> Text:
    parser = Text()
    parser.feed(page.read_text(encoding="utf-8"))
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
    found = [sentence for text in parsed.texts for sentence in english_sentences(text)]
    assert not found, f"English sentences on {page.name}: {found}"
    chrome = [text for text in parsed.attributes if re.fullmatch(r"(Search|Toggle \w+ sidebar|Download this page|"
                                                                r"Link to this \w+|Main|Color mode)\W*", text)]
    assert not chrome, chrome


@pytest.mark.skipif(not PAGES, reason="the book is not built (jupyter-book build .)")
def test_every_japanese_page_is_built():
    expected = {path.stem for path in (ROOT / "book" / "ja").glob("[0-9][0-9]_*.ipynb")} | {"glossary"}
    assert expected <= {page.stem for page in PAGES}
