"""A Sphinx extension of the book's build: the Japanese pages' glyphs travel with the book.

A reader whose system has no Japanese font (many Linux desktops, fresh containers) would see empty
boxes for every kana and kanji. The build copies IPAexGothic, the font matplotlib-fontja ships for the
Japanese plots, into `_static/` with its licence, and puts it first in the theme's text and heading
font families for CJK code points only (`unicode-range`), so Latin text keeps the reader's system
font. First, not last: appended after the system fonts, Chromium drew bold Japanese (`<strong>`,
admonition titles, sidebar captions) as empty boxes on a machine without a Japanese font, regular
text correctly (checked in headless Chromium, 2026-12-03). The face is declared at weight 400 only: IPAexGothic
has one weight, and declared for 100-900 the browser drew `<strong>` Japanese at that weight, not bold; at 400
it draws bold as synthetic bold (checked in headless Chromium, 2026-12-06). `_config.yml` names this module
under `sphinx.extra_extensions`.

The book's figures use the same font (matplotlib-fontja, `book.set_language("ja")`), and a Japanese title
is wider than its English one: `fit_titles(fig)`, which every plotting function of the lab ends with,
wraps a title that would extend past its figure (at a space in English, between characters in Japanese,
by the line-breaking rules) and lays the figure out again.
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
  font-weight: 400;
  font-display: swap;
}}
:root {{
  --pst-font-family-base: "{FAMILY}", var(--pst-font-family-base-system);
  --pst-font-family-heading: "{FAMILY}", var(--pst-font-family-base-system);
  --pst-font-family-monospace: var(--pst-font-family-monospace-system), "{FAMILY}";
}}
/* Japanese table headers break at their spaces, not inside a word (「画像サイ/ズ」); so do the glossary's terms */
html[lang="ja"] th, html[lang="ja"] .glossary td:nth-child(-n+4) {{ word-break: keep-all; }}
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


# --------------------------------------------------------------------------- figure titles that fit

#: Characters a line may not start with (closing punctuation, the prolonged sound mark) or end with (opening
#: brackets): the Japanese line-breaking rules (禁則), which a title wrapped between any two characters keeps.
NO_LINE_START = "、。，．・：；？！ー）」』】〉》〕…%)]},.:;!?"
NO_LINE_END = "（「『【〈《〔([{"
#: Where a Japanese line breaks naturally: after a particle or a punctuation mark.
BREAK_AFTER = "のをにでとはがもへや、。：）」"
#: Pixels kept free at the figure's edges.
MARGIN_PX = 4


def _titles(fig) -> list:
    found = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        found += [ax.title, ax._left_title, ax._right_title]
    return [text for text in found if text.get_text()]


def _breakable(line: str, i: int) -> bool:
    """Whether `line` may break before its character `i`: not inside an English word or number, and not
    against the line-breaking rules."""
    before, after = line[i - 1], line[i]
    if before.isascii() and after.isascii() and (before.isalnum() or after.isalnum()) and " " not in (before, after):
        return False
    return after not in NO_LINE_START and before not in NO_LINE_END


def wrap_line(line: str, fits) -> list[str]:
    """`line` in as few lines as `fits(text)` allows, breaking at a space where one is close, else between
    any two characters the line-breaking rules allow (Japanese has no spaces between words)."""
    lines = []
    while line and not fits(line):
        end = 1
        while end < len(line) and fits(line[:end + 1]):
            end += 1
        spaces = [i for i in range(1, end + 1) if i < len(line) and line[i] == " "]
        english = sum(c.isascii() for c in line[:end]) > 0.8 * end
        if spaces and (english or spaces[-1] >= end // 2):
            cut = spaces[-1]
        else:  # after a particle or punctuation where one is close, else between any two characters allowed
            allowed = [i for i in range(end, 0, -1) if _breakable(line, i)]
            natural = [i for i in allowed if i >= 0.6 * end and line[i - 1] in BREAK_AFTER]
            cut = (natural or allowed or [end])[0]
        lines.append(line[:cut].rstrip())
        line = line[cut:].lstrip()
    return lines + ([line] if line else [])


def fit_titles(fig, relayout: bool = True, rect=None):
    """Wrap every title and the figure's suptitle that would extend past the figure (a long Japanese title
    is wider than its English one at the same size), laying the figure out (`fig.tight_layout(rect=rect)`)
    before and after with `relayout`. Returns `fig`."""
    if relayout:
        fig.tight_layout(rect=rect)
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width
    for text in _titles(fig):
        box = text.get_window_extent(renderer)
        if box.x0 >= MARGIN_PX and box.x1 <= width - MARGIN_PX:
            continue
        align = text.get_horizontalalignment()
        room = (width - box.x0 - MARGIN_PX if align == "left" else box.x1 - MARGIN_PX if align == "right"
                else 2 * min((box.x0 + box.x1) / 2, width - (box.x0 + box.x1) / 2) - 2 * MARGIN_PX)
        prop = text.get_fontproperties()

        def fits(candidate: str, prop=prop, room=room) -> bool:
            return renderer.get_text_width_height_descent(candidate, prop, ismath=False)[0] <= room

        text.set_text("\n".join(part for line in text.get_text().split("\n") for part in wrap_line(line, fits)))
    if relayout:
        fig.tight_layout(rect=rect)
    return fig
