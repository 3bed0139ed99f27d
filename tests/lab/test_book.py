"""book (display only): source listings fail loudly on a missing anchor, chapter anchors exist,
nothing in the package imports book, and tools/nb.py keeps the reference outputs of tagged cells."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

from maskrcnn_tut.lab import book

ROOT = Path(__file__).resolve().parents[2]


def sample(x):
    first = x + 1
    second = first * 2
    third = second - 3
    return third


def test_source_listing_shows_from_start_to_stop():
    listing = book.source_listing(sample, start="second =", stop="third =")
    code = listing.split("```python\n")[1]
    assert code == "    second = first * 2\n    third = second - 3\n```"
    first_line = sample.__code__.co_firstlineno
    assert listing.startswith(f"`tests/lab/test_book.py`, lines {first_line + 2}-{first_line + 3}:")
    assert "def sample" in book.source_listing(sample) and "return third" in book.source_listing(sample)


@pytest.mark.parametrize("anchors, message", [
    ({"start": "fourth ="}, "the start anchor 'fourth =' is not in its code"),
    ({"stop": "fourth ="}, "the stop anchor 'fourth =' is not in its code"),
    ({"start": "third =", "stop": "first ="}, "the stop anchor 'first =' is not in its code after line"),
])
def test_a_missing_anchor_is_an_error_not_the_wrong_code(anchors, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        book.source_listing(sample, **anchors)
    with pytest.raises(ValueError, match="update the chapter's anchor"):
        book.show_source(sample, **anchors)


def test_every_chapter_anchor_is_in_the_code_it_names():
    call = re.compile(r"book\.show_source\((\w+)\.(\w+), start=\"([^\"]+)\", stop=\"([^\"]+)\"\)")
    found = 0
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            for module, name, start, stop in call.findall(cell.source if cell.cell_type == "code" else ""):
                book.source_listing(getattr(importlib.import_module(f"maskrcnn_tut.{module}"), name), start, stop)
                found += 1
    assert found >= 4


def test_nothing_in_the_package_imports_book():
    users = []
    for path in sorted((ROOT / "maskrcnn_tut").rglob("*.py")):
        if path.name == "book.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(n == "book" or n.endswith(".book") for n in names):
                users.append(str(path.relative_to(ROOT)))
    assert users == []


def test_nb_tool_keeps_only_the_tagged_cells_outputs(tmp_path):
    spec = importlib.util.spec_from_file_location("nb_tool", ROOT / "tools" / "nb.py")
    nb_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nb_tool)
    output = nbformat.v4.new_output("stream", name="stdout", text="checked\n")
    checked = nbformat.v4.new_code_cell("print('checked')", outputs=[output], execution_count=7,
                                        metadata={"tags": [nb_tool.CHECK_TAG]})
    other = nbformat.v4.new_code_cell("print('other')", execution_count=8,
                                      outputs=[nbformat.v4.new_output("stream", name="stdout", text="other\n")])
    path = tmp_path / "chapter.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[other, checked]), path)
    assert nb_tool.main([str(path)]) == 0
    other, checked = nbformat.read(path, as_version=4).cells
    assert other.outputs == [] and other.execution_count is None
    assert [o.text for o in checked.outputs] == ["checked\n"] and checked.execution_count == 2


def test_chapters_mark_checked_cells_with_the_tag_not_a_comment():
    tagged = 0
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            assert "NBVAL_CHECK_OUTPUT" not in cell.source, path.name
            tagged += "nbval-check-output" in cell.get("metadata", {}).get("tags", [])
    assert tagged >= 10
