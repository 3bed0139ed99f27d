"""Count the words of prose a reader sees in a chapter: the measure of issue 22's "at most about
2,000 words" for chapters 4, 8 and 9.

    python tools/prose_words.py _build/jupyter_execute/book/04_dataparallel_vs_ddp.ipynb ...

Run it on executed chapters (jupyter-book keeps them in `_build/jupyter_execute/book/`, or
`python tools/nb.py --execute` on a copy). Counted: markdown cells, and the Markdown that cells
tagged `remove-input` print (`book.prose`: measured paragraphs, read as prose). Not counted: code
cells and their other outputs (tables, plots, listings), fenced code, Markdown tables, and what the
page shows collapsed (`{dropdown}` directives, admonitions of class `dropdown`, cells tagged
`hide-output` or `hide-cell`, but not their titles); the collapsed words are reported beside the
visible ones.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

COLLAPSED_TAGS = {"hide-output", "hide-cell", "remove-output", "remove-cell"}
_FENCE = re.compile(r"^\s*(`{3,}|:{3,})\s*(\{[\w-]+\})?")


def split_markdown(text: str) -> tuple[str, str]:
    """(visible prose, collapsed prose) of a Markdown text: fenced code is dropped, MyST directives
    are kept as prose (their option lines dropped), dropdowns go to the collapsed part, tables are dropped."""
    visible, collapsed, stack = [], [], []  # stack: (fence, kind) with kind "code", "shown" or "collapsed"
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match and stack and line.strip() == stack[-1][0]:
            stack.pop()
            continue
        if match and (match.group(2) or not stack or stack[-1][1] != "code"):
            fence, directive = match.group(1), match.group(2)
            if directive is None:
                kind = "code"
            elif directive == "{dropdown}" or any(k == "collapsed" for _, k in stack):
                kind = "collapsed"
            else:
                kind = "shown"
            stack.append((fence, kind))
            if directive and not any(k == "collapsed" for _, k in stack[:-1]):
                visible.append(line[match.end():])  # a directive's title shows, even on a closed dropdown
            continue
        if stack and stack[-1][1] == "code":
            continue
        if stack and stack[-1][1] == "shown" and ":class: dropdown" in line:
            stack[-1] = (stack[-1][0], "collapsed")
            continue
        if line.lstrip().startswith(("|", ":")):
            continue  # a table row, or a directive's option line
        (collapsed if any(k == "collapsed" for _, k in stack) else visible).append(line)
    return "\n".join(visible), "\n".join(collapsed)


def count_words(text: str) -> int:
    """Words as a reader counts them: link targets and Markdown marks dropped, tokens with a letter or digit."""
    text = re.sub(r"\]\([^)]*\)", "]", text)  # [text](url) -> [text]
    text = re.sub(r"<[^>\s]+>", "", text)  # {download}`name <path>` -> name
    return sum(1 for token in text.split() if re.search(r"\w", token))


def chapter_words(path: Path | str) -> dict[str, int]:
    """{"visible": words a reader sees, "collapsed": words behind dropdowns} of one executed chapter."""
    nb = json.loads(Path(path).read_text())
    visible = collapsed = 0
    for cell in nb["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        texts = []
        if cell["cell_type"] == "markdown":
            texts = ["".join(cell["source"])]
        elif "remove-input" in tags:
            texts = ["".join(out["data"]["text/markdown"]) for out in cell.get("outputs", [])
                     if "text/markdown" in out.get("data", {})]
        for text in texts:
            shown, hidden = split_markdown(text)
            if tags & COLLAPSED_TAGS:
                shown, hidden = "", text
            visible += count_words(shown)
            collapsed += count_words(hidden)
    return {"visible": visible, "collapsed": collapsed}


def main(argv: list[str]) -> int:
    for path in argv:
        words = chapter_words(path)
        print(f"{Path(path).name}: {words['visible']} words of prose visible, {words['collapsed']} collapsed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
