"""Every catalog entry is named literally somewhere, and every literal key names an entry.

A key written whole (`say("bench.table_title")`, or a table of keys) is what a writer greps for; a key
built at run time (`say(f"bench.{name}")`) hides which entries are alive. This reads the package's
Python and the chapters' code cells as text, so it holds only while keys are written literally.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from maskrcnn_tut.lab import wording

ROOT = Path(__file__).resolve().parents[2]
NOT_KEYS = {"json", "py", "ipynb", "pt", "md", "txt", "png", "svg", "csv", "jsonl", "yml", "log", "gz", "html"}


def catalog_keys() -> set[str]:
    return {f"{name}.{entry}" for name in wording.catalog_names() if name != "terms"
            for entry in wording.catalog(name)}


def sources() -> dict[str, str]:
    """The package's Python and the chapters' code cells (both editions), by file."""
    found = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
             for path in sorted((ROOT / "maskrcnn_tut").rglob("*.py"))}
    for path in sorted((ROOT / "book").rglob("*.ipynb")):
        if "_build" in path.parts:
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        found[str(path.relative_to(ROOT))] = "\n".join("".join(cell["source"]) for cell in cells
                                                      if cell["cell_type"] == "code")
    return found


def keys_in(text: str) -> set[str]:
    """Every quoted "<catalog>.<entry>" in `text`."""
    names = "|".join(re.escape(name) for name in wording.catalog_names() if name != "terms")
    pattern = re.compile(rf"""["']((?:{names})\.([A-Za-z_][A-Za-z0-9_]*))["']""")
    return {match.group(1) for match in pattern.finditer(text) if match.group(2) not in NOT_KEYS}


def literal_keys() -> dict[str, set[str]]:
    """Every literal key in the sources, with the files that write it."""
    keys: dict[str, set[str]] = {}
    for where, text in sources().items():
        for key in keys_in(text):
            keys.setdefault(key, set()).add(where)
    return keys


def test_every_catalog_entry_is_named_literally_by_some_code():
    unused = sorted(catalog_keys() - set(literal_keys()))
    assert not unused, f"{len(unused)} catalog entries no code names literally: {unused}"


def test_every_literal_key_names_a_catalog_entry():
    missing = {key: sorted(where) for key, where in literal_keys().items() if key not in catalog_keys()}
    assert not missing, f"keys no catalog holds: {missing}"


def test_a_key_built_at_run_time_is_caught():
    """The check can fail: an f-string key leaves its entries unnamed."""
    assert keys_in('say(f"bench.{name}")') == set()
    assert keys_in('say("bench.table_title") if x else say(\'ch04.overlap\')') == {"bench.table_title", "ch04.overlap"}
    assert keys_in('open("bench.json")') == set()
