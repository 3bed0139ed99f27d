"""A Sphinx extension of the book's build: the Japanese pages' glyphs travel with the book.

A reader whose system has no Japanese font (many Linux desktops, fresh containers) would see empty
boxes for every kana and kanji. The build copies IPAexGothic, the font matplotlib-fontja ships for the
Japanese plots, into `_static/` with its licence, and puts it first in the theme's text and heading
font families for CJK code points only (`unicode-range`), so Latin text keeps the reader's system
font. First, not last: appended after the system fonts, Chromium drew bold Japanese (`<strong>`,
admonition titles, sidebar captions) as empty boxes on a machine without a Japanese font, regular
text correctly (checked in headless Chromium, 2026-12-03). `_config.yml` names this module under
`sphinx.extra_extensions`.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

#: Kana, CJK punctuation and ideographs, and full-width forms: the code points the font is fetched for.
CJK_RANGES = "U+3000-30FF, U+3400-4DBF, U+4E00-9FFF, U+F900-FAFF, U+FF00-FFEF"
FAMILY = "IPAexGothic (book)"
CSS = f"""@font-face {{
  font-family: "{FAMILY}";
  src: url("ipaexg.ttf") format("truetype");
  unicode-range: {CJK_RANGES};
  font-weight: 100 900;
  font-display: swap;
}}
:root {{
  --pst-font-family-base: "{FAMILY}", var(--pst-font-family-base-system);
  --pst-font-family-heading: "{FAMILY}", var(--pst-font-family-base-system);
  --pst-font-family-monospace: var(--pst-font-family-monospace-system), "{FAMILY}";
}}
"""


def _add_font(app) -> None:
    import matplotlib_fontja
    fonts = Path(matplotlib_fontja.__file__).parent / "fonts"  # ipaexg.ttf and its licence
    css = Path(tempfile.mkdtemp(prefix="book-fonts-"))
    (css / "japanese-font.css").write_text(CSS, encoding="utf-8")
    app.config.html_static_path.extend([str(fonts), str(css)])
    app.add_css_file("japanese-font.css")


def setup(app) -> dict:
    app.connect("builder-inited", _add_font)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
