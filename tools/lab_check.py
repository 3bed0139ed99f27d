"""Run a chapter the way a hub reader does: in JupyterLab, from headless Chromium, then screenshot it.

    python tools/lab_check.py book/03_dataloader_tuning.ipynb --screenshot lab.png

Starts JupyterLab on a copy of `book/` (so autosave never touches the repository), opens the chapter,
runs every cell from the browser, and fails when a cell errs, when a `{glue` placeholder shows as raw
text, or when no paragraph with measured numbers was displayed. A developer check, not part of
`pytest`: it needs `pip install jupyterlab playwright` and Chromium at /usr/bin/chromium (Debian's
`chromium` package); Playwright drives that Chromium, so nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]

#: Read in the page, through the app object `--expose-app-in-browser` gives: each cell's kind, execution
#: count, output types and output text.
CELLS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  return panel.content.widgets.map(cell => {
    const model = cell.model;
    const outputs = model.type === 'code' ? model.outputs.toJSON() : [];
    return {type: model.type, count: model.type === 'code' ? model.executionCount : null,
            outputs: outputs.map(o => ({type: o.output_type,
              text: JSON.stringify(o.data || o.text || o.evalue || '')}))};
  });
}"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_server(url: str, lab: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lab.poll() is not None:
            raise SystemExit(f"error: JupyterLab exited with {lab.returncode} before it served {url}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"error: JupyterLab did not answer at {url} within {timeout_s:.0f} s")


def check(chapter: Path, screenshot: Path, timeout_s: float, cell: int | None = None) -> dict:
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="lab-check-"))
    shutil.copytree(REPO / "book", work / "book", ignore=shutil.ignore_patterns("_build", ".ipynb_checkpoints"))
    port, token = _free_port(), secrets.token_hex(16)
    lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
                            f"--ServerApp.token={token}", f"--ServerApp.root_dir={work}", "--expose-app-in-browser",
                            "--LabApp.news_url=None",
                            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                           cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for_server(f"{base}/api/status?token={token}", lab, 60)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(f"{base}/lab/tree/book/{chapter.name}?token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.content", timeout=90_000)
            page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                                   ".status === 'idle'", timeout=90_000)
            started = time.monotonic()
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            page.wait_for_function(
                "() => { const w = window.jupyterapp.shell.currentWidget;"
                " return w.content.widgets.every(c => c.model.type !== 'code' || c.model.executionCount !== null)"
                " && w.sessionContext.session.kernel.status === 'idle'; }",
                timeout=timeout_s * 1000, polling=1000)
            run_s = time.monotonic() - started
            cells = page.evaluate(CELLS_JS)
            errors = [i for i, c in enumerate(cells) if any(o["type"] == "error" for o in c["outputs"])]
            raw_glue = [i for i, c in enumerate(cells) if any("{glue" in o["text"] for o in c["outputs"])]
            prose = [i for i, c in enumerate(cells) if any(o["type"] == "display_data" and "text/markdown" in o["text"]
                                                          and re.search(r"\d", o["text"]) for o in c["outputs"])]
            news = page.get_by_role("button", name="No")  # JupyterLab's "get news?" toast
            if news.count():
                news.first.click()
            if prose:  # show a paragraph of measured numbers from the middle of the chapter, as the reader sees it
                shown = prose[len(prose) // 2] if cell is None else cell
                page.evaluate(f"""() => {{ const w = window.jupyterapp.shell.currentWidget.content;
                    w.activeCellIndex = {shown}; w.scrollToItem({shown}, 'start'); }}""")
                page.wait_for_timeout(1500)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot))
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return {"chapter": chapter.name, "cells": len(cells), "run_all_s": round(run_s, 1), "cells_with_errors": errors,
            "outputs_with_raw_glue": raw_glue, "cells_with_measured_prose": prose, "screenshot": str(screenshot)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=Path)
    parser.add_argument("--screenshot", type=Path, default=Path("lab-check.png"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds for running every cell")
    parser.add_argument("--cell", type=int, help="the cell to scroll to for the screenshot (default: a measured "
                                                 "paragraph from the middle of the chapter)")
    args = parser.parse_args(argv)
    result = check(args.chapter, args.screenshot, args.timeout, args.cell)
    print(json.dumps(result, indent=2))
    failed = result["cells_with_errors"] or result["outputs_with_raw_glue"] or not result["cells_with_measured_prose"]
    if failed:
        print("error: the chapter did not read right in JupyterLab (see above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
