"""The book's build serves a Japanese font, so that kana and kanji never render as empty boxes."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from maskrcnn_tut.lab import book_fonts


def test_the_build_copies_the_font_and_appends_it_to_the_themes_families_for_cjk_only():
    handlers, css_files = {}, []
    app = SimpleNamespace(config=SimpleNamespace(html_static_path=[]), add_css_file=css_files.append,
                          connect=lambda event, fn: handlers.setdefault(event, fn))
    book_fonts.setup(app)
    handlers["builder-inited"](app)
    folders = [Path(p) for p in app.config.html_static_path]
    assert any((folder / "ipaexg.ttf").stat().st_size > 1_000_000 for folder in folders)
    assert any((folder / "IPA_Font_License_Agreement_v1.0.txt").exists() for folder in folders)
    css = next((folder / css_files[0]).read_text() for folder in folders if (folder / css_files[0]).exists())
    assert 'url("ipaexg.ttf")' in css and "unicode-range: U+3000-30FF" in css
    assert '--pst-font-family-heading: "IPAexGothic (book)", var(--pst-font-family-base-system)' in css
