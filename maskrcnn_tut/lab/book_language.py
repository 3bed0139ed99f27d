"""A Sphinx extension of the book's build: the Japanese pages are Japanese pages, chrome and all.

Jupyter Book 1.x builds both editions as one Sphinx project, and Sphinx has one `language` for a
project: left alone, every page of the Japanese edition says `<html lang="en">` (screen readers read it
with an English voice, browsers offer to translate it "from English"), carries the English book title,
and its site chrome (search, "Contents", "Click to show", previous/next, the permalinks' titles) is
English. For each page under `book/ja/` this extension, on `html-page-context`:

- sets the page's `language` to "ja" (the theme writes it as `<html lang="ja">`) and its title and the
  navbar's book title to `TITLE_JA`;
- renders the theme's template strings through Japanese catalogs: Sphinx's, pydata-sphinx-theme's and
  sphinx-book-theme's own `ja` catalogs, with `terms.json`'s entries for the strings they leave in English
  (`CHROME`, the English messages looked up there first);
- words sphinx-togglebutton's "Click to show/hide" hint, and the chrome already in the page's body (the
  permalinks' titles, the labels of hidden cells and answers), in Japanese;
- once the pages are written, leaves the English edition out of a Japanese page's sidebar and previous/next
  links (each page links to its English twin at its top).

Every other page is rendered with the project's (English) catalogs, as before: the swap is undone on
the next page. `_config.yml` names this module under `sphinx.extra_extensions`.
"""
from __future__ import annotations

import gettext
import html
import re
from pathlib import Path

#: The Japanese pages: Sphinx's page names of the Japanese edition.
PREFIX = "book/ja/"
#: The book's title on the Japanese pages (the English one is `_config.yml`'s `title`).
TITLE_JA = "PyTorch による Mask R-CNN の高速な分散学習"
#: The book's author as `_config.yml` names it; its Japanese is in terms.json.
AUTHOR = "the maskrcnn-tut authors"
#: The site chrome's English messages the theme catalogs leave in English; their Japanese is in terms.json.
CHROME = ("Search", "Search this book", "Search the docs ...", "Site Navigation", "Table of Contents",
          "System Settings", "Link to this heading", "Link to this table", "Link to this image",
          "Link to this code", "Link to this definition", "Link to this equation", "previous", "next",
          "previous page", "next page", "Click to show", "Click to hide", "Contents", "Skip to main content",
          "Back to top", "Color mode", "Toggle navigation", "Toggle primary sidebar", "Toggle secondary sidebar",
          "Download this page", "Fullscreen mode", "Print to PDF", "Download notebook file",
          "Download source file", "By", "Launch", "Main", "Toggle hidden content", "Show the answers",
          "Hide the answers", "Show code cell output", "Hide code cell output", "Show code cell outputs",
          "Hide code cell outputs", "Show code cell source", "Hide code cell source", "Show code cell content",
          "Hide code cell content")
#: Chrome the themes' templates write in English without a message catalog (attribute values), replaced in the
#: Japanese pages once they are written.
HARD_CODED = ('title="Toggle primary sidebar"', 'title="Toggle secondary sidebar"', 'aria-label="Main"',
              'aria-label="Download this page"')
#: Chrome inside a page's body: the permalinks' titles, the labels of hidden cells (myst-nb's "Show code cell
#: outputs", a cell's own "Show the answers") and their toggles' aria-labels.
_BODY_CHROME = re.compile(r'(title="|aria-label="|<p class="(?:collapsed|expanded) admonition-title">)([^"<]+)(?=["<])')


class _Terms(gettext.NullTranslations):
    """terms.json's Japanese for the chrome messages, then the fallback catalogs."""

    def __init__(self, japanese: dict[str, str]):
        super().__init__()
        self._japanese = japanese

    def gettext(self, message):
        message = str(message)  # sphinx-book-theme's buttons hand over lazy translations
        return self._japanese.get(message) or super().gettext(message)

    def ngettext(self, singular, plural, n):
        singular, plural = str(singular), str(plural)
        return self._japanese.get(singular if n == 1 else plural) or super().ngettext(singular, plural, n)


def _catalog(domain: str, folder: Path) -> gettext.NullTranslations:
    try:
        return gettext.translation(domain, str(folder), languages=["ja"])
    except OSError:  # a theme version without a Japanese catalog: the terms and the other catalogs stay
        return gettext.NullTranslations()


def japanese_catalogs() -> dict[str, gettext.NullTranslations]:
    """The Japanese translations for the templates' `_` (Sphinx's and pydata-sphinx-theme's messages) and
    for sphinx-book-theme's `translate`, each behind terms.json's entries for `CHROME`."""
    import pydata_sphinx_theme
    import sphinx
    import sphinx_book_theme
    import sphinx_togglebutton

    from .wording import catalog

    terms = catalog("terms")
    japanese = {message: terms[message] for message in (*CHROME, AUTHOR) if message in terms}
    sphinx_ja = _catalog("sphinx", Path(sphinx.__file__).parent / "locale")
    sphinx_ja.add_fallback(_catalog("sphinx", Path(pydata_sphinx_theme.__file__).parent / "locale"))
    sphinx_ja.add_fallback(_catalog("togglebutton", Path(sphinx_togglebutton.__file__).parent / "translations"
                                    / "locales"))
    templates = _Terms(japanese)
    templates.add_fallback(sphinx_ja)
    book = _Terms(japanese)
    book.add_fallback(_catalog("booktheme", Path(sphinx_book_theme.__file__).parent / "theme" / "sphinx_book_theme"
                               / "static" / "locales"))
    return {"templates": templates, "book": book}


def is_japanese(pagename: str) -> bool:
    return pagename.startswith(PREFIX)


def _page_context(app, pagename, templatename, context, doctree) -> None:
    environment = app.builder.templates.environment
    if not is_japanese(pagename):
        environment.install_gettext_translations(app.translator)  # the project's catalogs, as Sphinx set them
        return
    catalogs = app.builder.japanese_catalogs = getattr(app.builder, "japanese_catalogs", None) or japanese_catalogs()
    environment.install_gettext_translations(catalogs["templates"])
    say, book = catalogs["templates"].gettext, catalogs["book"].gettext
    context["language"] = "ja"
    context["docstitle"] = TITLE_JA  # the page's <title> suffix and the navbar's book title
    context["translate"] = book
    context["theme_search_bar_text"] = say("Search this book") + "…"
    context["author"] = say(context.get("author") or "")  # terms.json's Japanese for _config.yml's author
    if "body" in context:
        context["body"] = _BODY_CHROME.sub(lambda m: m.group(1) + html.escape(say(html.unescape(m.group(2)))),
                                           context["body"])
    context["script_files"] = [_toggle_hint(script, say) for script in context.get("script_files", [])]


def _toggle_hint(script, say):
    """sphinx-togglebutton's hint, a global script `let toggleHintShow = '...';`, in Japanese."""
    body = getattr(script, "attributes", {}).get("body") if hasattr(script, "attributes") else None
    if not body or "toggleHint" not in body:
        return script
    for english in ("Click to show", "Click to hide"):
        body = body.replace(f"'{english}'", f"'{say(english)}'")
    return type(script)(script.filename, **{**script.attributes, "body": body, "priority": script.priority})


#: In a Japanese page's sidebar: the home link (the English preface, the book's root) and the English part
#: (its caption and its chapters, up to the next part's caption).
_ENGLISH_NAV = re.compile(r'<ul class="nav bd-sidenav bd-sidenav__home-link">.*?</ul>\s*'
                          r'|<p aria-level="2" class="caption" role="heading"><span class="caption-text">English</span>'
                          r'</p>.*?(?=<p aria-level="2" class="caption")', re.S)
#: A previous/next link out of the Japanese edition (the Japanese preface follows the English part's last page).
_OUT_OF_EDITION = re.compile(r'<a class="(?:left-prev|right-next)"\s+href="\.\./[^"]*".*?</a>', re.S)


def japanese_page(text: str, say) -> str:
    """A written Japanese page with the chrome its templates hard-code in English in Japanese (`HARD_CODED`),
    and without the English edition in its sidebar and its previous/next links: the Japanese edition is the
    reader's book (each page links to its English twin at its top)."""
    for attribute in HARD_CODED:
        name, _, value = attribute.partition("=")
        text = text.replace(attribute, f'{name}="{html.escape(say(value.strip(chr(34))))}"')
    return _OUT_OF_EDITION.sub("", _ENGLISH_NAV.sub("", text))


def _finish(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    say = japanese_catalogs()["templates"].gettext
    for page in (Path(app.outdir) / PREFIX).rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        fixed = japanese_page(text, say)
        if fixed != text:
            page.write_text(fixed, encoding="utf-8")


def setup(app) -> dict:
    app.connect("html-page-context", _page_context, priority=900)  # after the themes' own handlers
    app.connect("build-finished", _finish)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
