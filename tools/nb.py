"""Prepare the book's chapters for committing: (run and) strip them.

    python tools/nb.py [--execute] book/*.ipynb

Outputs are cleared except those of cells tagged `nbval-check-output`: they are the reference
outputs nbval compares a fresh run against (`pytest --nbval-lax`). With `--execute` each chapter
is first run in place, in its own folder (as `jupyter-book build` and nbval run it), which
refreshes those reference outputs. Not part of the installed package: it needs nbformat and
nbclient, which only the book's tooling does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import nbformat

#: The cell tag that makes nbval compare a cell's outputs under --nbval-lax.
CHECK_TAG = "nbval-check-output"


def checked(cell) -> bool:
    """Whether nbval compares this code cell's outputs."""
    return CHECK_TAG in cell.metadata.get("tags", [])


def execute_notebook(path: Path | str, timeout: int = 600) -> None:
    """Run a chapter in place, in its own folder."""
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).resolve().parent)}}).execute()
    nbformat.write(nb, path)


def strip_outputs(path: Path | str) -> None:
    """Clear a notebook's outputs except those of tagged cells (nbval's reference)."""
    nb = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code_cells, 1):
        cell.metadata.pop("execution", None)
        keep = checked(cell) and bool(cell.outputs)
        # nbval compares a cell's outputs only if the stored cell counts as run
        cell.execution_count = number if keep else None
        if not keep:
            cell.outputs = []
        for output in cell.outputs:
            output.pop("execution_count", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/nb.py",
        description=f"Prepare chapters for committing: outputs cleared except the reference outputs of "
                    f"cells tagged '{CHECK_TAG}', which nbval compares against.")
    parser.add_argument("notebooks", nargs="+", help="chapter notebooks, e.g. book/07_gradient_accumulation.ipynb")
    parser.add_argument("--execute", action="store_true",
                        help="run each chapter first, refreshing the reference outputs")
    args = parser.parse_args(argv)
    for notebook in args.notebooks:
        if args.execute:
            execute_notebook(notebook)
        strip_outputs(notebook)
        print(f"{'executed and ' if args.execute else ''}stripped {notebook}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
