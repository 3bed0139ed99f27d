"""tools/prose_words.py: the words of prose a reader sees in a chapter (issue 22's measure)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "prose_words.py"
spec = importlib.util.spec_from_file_location("prose_words", TOOL)
prose_words = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prose_words)


def cell(kind, source, tags=(), outputs=()):
    found = {"cell_type": kind, "source": source, "metadata": {"tags": list(tags)}}
    return {**found, "outputs": list(outputs)} if kind == "code" else found


def markdown_output(text):
    return {"output_type": "display_data", "data": {"text/markdown": text}}


def test_counts_prose_and_measured_paragraphs_not_code_tables_or_collapsed(tmp_path):
    chapter = {"cells": [
        cell("markdown", "# Two words\n\nThree more words, [linked](http://x).\n\n```python\nx = 1 + 2\n```\n"
                         "| a | table |\n|---|---|\n\n:::{admonition} Hidden title\n:class: dropdown\nfour hidden words here\n:::\n"
                         "```{note}\nshown note\n```"),
        cell("code", "book.prose(...)", ["remove-input"], [markdown_output("A measured paragraph of six.")]),
        cell("code", "book.prose(...)", ["remove-input", "hide-output"], [markdown_output("collapsed answer")]),
        cell("code", "book.show_table(rows)", [], [markdown_output("| not | prose |")]),
    ]}
    path = tmp_path / "chapter.ipynb"
    path.write_text(json.dumps(chapter))
    # 2 + 4 (heading, sentence with the link's text) + 2 (the dropdown's title) + 2 (the note) + 5 visible;
    # 4 (the dropdown's body) + 2 (the hidden output) collapsed
    assert prose_words.chapter_words(path) == {"visible": 15, "collapsed": 6}
