"""The Japanese pages of the book's build are Japanese pages: `<html lang="ja">`, the Japanese book title and
Japanese site chrome (lab/book_language.py), while the English pages stay English. Built here with the
book's theme on three small pages, the Japanese one written before the English one, so the test also sees
the English catalogs restored after a Japanese page."""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from maskrcnn_tut.lab import book_language

#: Chrome the themes write in English, with the attribute or text each is found in.
ENGLISH_CHROME = re.compile(r"\b(Search|Contents|Click to (?:show|hide)|previous|next|Toggle \w+ sidebar|"
                            r"Link to this \w+|Skip to main content|Back to top|Download this page|Main|By)\b")


class Visible(HTMLParser):
    """The text a reader sees or hears: text outside scripts and styles, and titles, labels and placeholders."""

    def __init__(self):
        super().__init__()
        self.inside, self.found = 0, []

    def handle_starttag(self, tag, attrs):
        self.inside += tag in ("script", "style")
        self.found += [value for name, value in attrs if name in ("title", "aria-label", "placeholder") and value]

    def handle_endtag(self, tag):
        self.inside -= tag in ("script", "style")

    def handle_data(self, data):
        if not self.inside and data.strip():
            self.found.append(data.strip())


def visible(page: str) -> list[str]:
    parser = Visible()
    parser.feed(page)
    return parser.found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("sphinx_book_theme")
    from sphinx.application import Sphinx

    src = tmp_path_factory.mktemp("src")
    (src / "book" / "ja").mkdir(parents=True)
    (src / "conf.py").write_text(
        'project = "Fast distributed Mask R-CNN training in PyTorch"\nauthor = "the maskrcnn-tut authors"\n'
        'html_theme = "sphinx_book_theme"\nhtml_title = project\n'
        'extensions = ["sphinx_togglebutton", "maskrcnn_tut.lab.book_language"]\n', encoding="utf-8")
    (src / "index.rst").write_text("Intro\n=====\n\n.. toctree::\n\n   book/ja/page\n   book/page\n", encoding="utf-8")
    (src / "book" / "page.rst").write_text("Page\n====\n\nEnglish text.\n\nSection\n-------\n\nMore.\n", encoding="utf-8")
    (src / "book" / "ja" / "page.rst").write_text("ページ\n======\n\n日本語の文です。\n\n節\n--\n\n続きです。\n",
                                                  encoding="utf-8")
    out = tmp_path_factory.mktemp("html")
    app = Sphinx(str(src), str(src), str(out), str(out / ".doctrees"), "html", status=None, warning=None,
                 freshenv=True)
    app.build()
    return {name: (out / f"{name}.html").read_text(encoding="utf-8") for name in ("book/ja/page", "book/page")}


def test_a_japanese_page_says_it_is_japanese_with_the_japanese_title(built):
    page = built["book/ja/page"]
    assert re.search(r'<html[^>]* lang="ja"', page)
    assert re.search(rf"<title>ページ[^<]*{book_language.TITLE_JA}</title>", page)
    assert book_language.TITLE_JA in visible(page)


def test_a_japanese_pages_chrome_is_japanese(built):
    page = built["book/ja/page"]
    english = [text for text in visible(page) if ENGLISH_CHROME.search(text)]
    assert not english, english
    assert "toggleHintShow = 'クリックして表示'" in page
    assert 'title="この見出しへのリンク"' in page and "目次" in visible(page)


def test_an_english_page_stays_english_after_a_japanese_one(built):
    page = built["book/page"]
    assert re.search(r'<html[^>]* lang="en"', page)
    assert "Fast distributed Mask R-CNN training in PyTorch" in page and book_language.TITLE_JA not in page
    assert "Toggle primary sidebar" in page and "toggleHintShow = 'Click to show'" in page
    assert not any(re.search(r"[\u3040-\u30ff]", text) for text in visible(page) if text != "ページ")


def test_a_japanese_pages_sidebar_and_footer_keep_to_the_japanese_edition():
    page = ('<ul class="nav bd-sidenav bd-sidenav__home-link"><li><a href="../00_preface.html">Preface: ...</a></li>'
            '</ul>\n<p aria-level="2" class="caption" role="heading"><span class="caption-text">English</span></p>\n'
            '<ul class="nav bd-sidenav"><li><a href="../01_why.html">1. Why multiple GPUs</a></li></ul>\n'
            '<p aria-level="2" class="caption" role="heading"><span class="caption-text">日本語版</span></p>\n'
            '<ul class="current nav bd-sidenav"><li><a href="00_preface.html">まえがき</a></li></ul>'
            '<a class="left-prev"\n href="../execution_times.html"><p>How long each chapter took</p></a>'
            '<a class="right-next"\n href="01_why.html"><p>1. 複数の GPU が必要な理由</p></a>'
            '<button title="Toggle primary sidebar"></button>')
    shown = book_language.japanese_page(page, book_language.japanese_catalogs()["templates"].gettext)
    assert "English" not in shown and "Preface" not in shown and "How long" not in shown
    assert "日本語版" in shown and "まえがき" in shown and 'href="01_why.html"' in shown
    assert 'title="左のサイドバーの切り替え"' in shown
