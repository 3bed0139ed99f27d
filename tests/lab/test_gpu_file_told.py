"""What chapters 5, 6 and 8 say about the committed GPU file (book/results/1x-nvidia-h200-2026-12-04.json), in
both editions: what its rows measured (short windows after the warm-up, dominated by first-shape steps, with their
spread), where they come from, and no ranking of precisions or cudnn settings; `gpu_files.gpu_file_is_steady`
gates every verdict, and `gpu_files.steady_sentences` is where a steady file's verdicts will be worded."""
from __future__ import annotations

import json
import re

import pytest

from maskrcnn_tut.lab import bench, book, wording
from maskrcnn_tut.lab.bench import gpu_files
from maskrcnn_tut.lab.stored.result import BenchResult, load_suite

H200 = book.RESULTS / "1x-nvidia-h200-2026-12-04.json"
BOOK = book.RESULTS.parent  # the English chapters; the Japanese ones in BOOK / "ja"
LABEL = {"en": "dominated by first-shape steps", "ja": "新しい形状のステップが大半を占める"}
#: What names a precision or a cudnn setting, and the words that would rank one.
SETTING = re.compile(r"fp16|bf16|fp32|float16|bfloat16|benchmark|autocast|AMP|精度")
VERDICT = {"en": re.compile(r"\b(faster|slower|fastest|slowest|quicker|best|worst|better|worse|wins?)\b", re.I),
           "ja": re.compile(r"速い|遅い|速く|遅く|最速|最良|最も|勝")}
#: Which parts each chapter shows (chapter 8: all of them).
CHAPTER_PARTS = {"05": ["amp"], "06": ["cudnn"], "08": None}


@pytest.fixture(autouse=True)
def english_afterwards():
    yield
    wording.set_language("en")


def shown_text(monkeypatch, capsys, folder, parts) -> str:
    """Everything `bench.show_gpu_results(folder, parts)` displays or prints, as chapters 5, 6 and 8 call it."""
    items = []
    monkeypatch.setattr("IPython.display.display", items.append)
    bench.show_gpu_results(folder, parts=parts)
    return "\n".join([item.to_markdown() if isinstance(item, BenchResult) else item.data for item in items]
                     + [capsys.readouterr().out])


def sentences(text: str) -> list[str]:
    return [part for part in re.split(r"(?<=[.;:])\s+|。|：|\n", text) if part.strip()]


def rankings(text: str, lang: str) -> list[str]:
    """The sentences that name a precision or a cudnn setting together with a verdict word."""
    return [sentence for sentence in sentences(text) if SETTING.search(sentence) and VERDICT[lang].search(sentence)]


@pytest.fixture
def h200_only(tmp_path):
    """A results folder holding the committed H200 file alone (later files must not change what it says)."""
    (tmp_path / H200.name).write_text(H200.read_text())
    return tmp_path


# --------------------------------------------------------------------------- the committed file


@pytest.mark.parametrize("lang", ["en", "ja"])
@pytest.mark.parametrize("chapter", sorted(CHAPTER_PARTS))
def test_the_chapters_label_the_h200_file_and_rank_nothing_from_it(chapter, lang, h200_only, monkeypatch, capsys):
    wording.set_language(lang)
    text = shown_text(monkeypatch, capsys, h200_only, CHAPTER_PARTS[chapter])
    assert LABEL[lang] in text
    assert rankings(text, lang) == []
    # where the figures come from: the machine, its torch (not the book's pinned one) and the date
    assert "1x NVIDIA H200" in text and "torch 2.11.0+cu130" in text and "2026-12-04" in text
    if chapter == "05":
        wording.set_language(lang)
        said = gpu_files.brief(h200_only, "amp")
        assert LABEL[lang] in said and rankings(said, lang) == [] and "2026-12-04" in said


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_the_amp_rows_say_their_steps_warm_up_spread_and_first_shape_steps(lang, h200_only, monkeypatch, capsys):
    wording.set_language(lang)
    text = shown_text(monkeypatch, capsys, h200_only, ["amp"])
    rows = json.loads(H200.read_text())["results"]["amp"]["rows"]
    for row in rows:  # each row's step count and spread, read from the file
        assert f"{row['steps']} " in text and f"{row['img/s lo']:.3g}-{row['img/s hi']:.3g}" in text
    assert ("after 5 warm-up steps" if lang == "en" else "ウォームアップ 5 ステップの後") in text
    assert ("cuDNN builds its convolution plans once for every new shape" if lang == "en"
            else "cuDNN は新しい形状ごとに 1 回、畳み込みのプランを作って") in text
    assert "best of those" not in text and "最良" not in text  # the stored note that ranked bf16 is left out


def test_the_file_says_what_it_cannot_show_and_how_its_cudnn_part_ended(h200_only, monkeypatch, capsys):
    text = shown_text(monkeypatch, capsys, h200_only, None)
    assert "cannot show: a steady-state speed, or a verdict between any two of its rows" in text
    assert "cudnn: did not finish: the launcher stopped it at its time limit after 133.641 s" in text
    assert "no row about cudnn.benchmark on or off" in text
    assert "hung" not in text and "/work/" not in text  # no "hung", no path of the machine that measured
    # the speed table's stored note counted the planned 20 steps; its row measured 10
    assert "median of 10 measured steps after 5 warm-up steps" in text and "median of 20" not in text


def test_the_slow_steps_and_their_share_come_from_the_file():
    _, parts, _ = load_suite(H200)
    fp32, fp16, bf16 = parts["amp"].rows
    assert gpu_files.slow_steps(fp32) == (6, pytest.approx(0.60, abs=0.01))
    assert gpu_files.slow_steps(fp16) == (2, pytest.approx(0.84, abs=0.01))
    assert gpu_files.slow_steps(bf16) == (2, pytest.approx(0.80, abs=0.01))
    assert gpu_files.warmup_steps(parts["amp"]) == 5 and gpu_files.dominated(parts["amp"])


# --------------------------------------------------------------------------- the gate and the hook


def steady_row(name: str, img_s: float) -> dict:
    return {"setting": name, "img/s": img_s, "img/s lo": img_s * 0.98, "img/s hi": img_s * 1.02, "steps": 40,
            "step s": [2 / img_s] * 40, "new-shape steps": 0, "img/s steady": img_s}


def test_only_rows_that_leave_their_new_shape_steps_out_are_steady():
    h200 = gpu_files.read(book.RESULTS)
    assert h200 and not any(gpu_files.gpu_file_is_steady(found) for found in h200 if found.name == H200.name)
    steady = BenchResult("amp", "AMP", [steady_row("fp32 (no autocast)", 30.0), steady_row("bf16 autocast", 32.0)],
                         ["setting", "img/s"])
    assert gpu_files.gpu_file_is_steady(steady)
    assert gpu_files.label(steady) == "steady state: new-shape steps left out"
    half = BenchResult("amp", "AMP", [steady_row("fp32 (no autocast)", 30.0),
                                      {k: v for k, v in steady_row("bf16 autocast", 32.0).items() if k != "img/s steady"}],
                       ["setting", "img/s"])
    assert not gpu_files.gpu_file_is_steady(half)
    assert not gpu_files.gpu_file_is_steady(BenchResult("amp", "AMP", [], ["setting"]))
    # bench.steady's rows: a median over the steady steps only, no "img/s" over all of them
    only_steady = [{k: v for k, v in steady_row(name, 30.0).items() if k != "img/s"} for name in ("fp32", "bf16")]
    assert gpu_files.gpu_file_is_steady(BenchResult("amp", "AMP", only_steady, ["setting", "img/s steady"]))


def test_a_steady_file_is_worded_by_the_steady_hook_alone(tmp_path, monkeypatch, capsys):
    rows = [steady_row("fp32 (no autocast)", 30.0), steady_row("bf16 autocast", 32.0)]
    (tmp_path / "1x-test-gpu-2027-01-01.json").write_text(json.dumps({
        "provenance": {"hardware": "1x Test GPU", "date": "2027-01-01T00:00", "command": "suite", "torch": "2.14.1"},
        "results": {"amp": {"name": "amp", "title": "AMP", "rows": rows, "columns": ["setting", "img/s"],
                            "notes": [wording.to_json(wording.english("bench.knob_moved", knob="amp_dtype", spread=0.07,
                                                                      key="img/s", best="bf16 autocast"))],
                            "provenance": {"command": "sweep_amp(warmup=5)"}}}}))
    monkeypatch.setattr(gpu_files, "steady_sentences", lambda result: ["THE STEADY VERDICTS"])
    text = shown_text(monkeypatch, capsys, tmp_path, ["amp"])
    assert "steady state: new-shape steps left out" in text and "THE STEADY VERDICTS" in text
    assert "best of those" not in text and "first-shape steps" not in text
    assert gpu_files.brief(tmp_path, "amp") == "THE STEADY VERDICTS"


# --------------------------------------------------------------------------- a steady file, as the device run writes it


def made_up_device_run(out) -> dict:
    """summary.json as `gpu_stages` writes it, from made-up step lines: bf16 20 % faster than fp32 in every
    round, fp16 the same as fp32, each after warm-up steps that met new shapes."""
    import random

    from maskrcnn_tut.lab.bench import gpu_stages, steady
    draw = random.Random(0)

    def setting(label, step_s):
        warm = [{"setting": label, "phase": "warm-up", "block": 0, "wall s": 0.9, "new shape": True, "data s": 0.0,
                 "shape": [800, 1088 + 32 * i], "rois": 9} for i in range(3)]
        measured = [{"setting": label, "phase": "measure", "block": 1 + i // 20, "data s": 0.001, "shape": [800, 1088],
                     "rois": 9, "wall s": step_s * (1 + draw.uniform(-0.02, 0.02)), "new shape": False} for i in range(60)]
        made = steady.Setting.__new__(steady.Setting)
        made.label, made.lines, made.rig = label, warm + measured, type("R", (), {"cfg": type("C", (), {"global_batch": 8})})
        return made

    settings = [setting("fp32", 0.100), setting("bf16", 0.083), setting("fp16", 0.100)]
    out.mkdir()
    gpu_stages.write_summary(out, "precision", {"rows": steady.compare(settings, "fp32"), "rounds": 3})
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_a_steady_file_states_the_verdicts_the_rule_gives(lang, tmp_path, monkeypatch, capsys):
    """The chapters on a steady file: each row's steady speed and what was left out, and each verdict as
    `bench.steady` gave it (bf16 faster than fp32 by its interval and rounds; fp16 within noise of it)."""
    from maskrcnn_tut.lab.bench import gpu_stages
    summary = made_up_device_run(tmp_path / "out")
    rows = {row["setting"]: row for row in summary["stages"]["precision"]["rows"]}
    assert (rows["bf16"]["verdict"], rows["fp16"]["verdict"]) == ("faster", "within noise")
    results = tmp_path / "results"
    results.mkdir()
    path = gpu_stages.results_file(tmp_path / "out", results)
    assert path.name.endswith("-steady.json")
    wording.set_language(lang)
    text = shown_text(monkeypatch, capsys, results, ["amp"])
    assert gpu_files.label(gpu_files.read(results)[0]) in text
    expected = {"en": ["faster than fp32", "within noise of fp32", "new-shape steps left out", "| faster |"],
                "ja": ["fp32 より速い", "fp32 との差がばらつきの範囲内", "新しい形状のステップ 0 個を除外", "| 速い |"]}[lang]
    for words in expected:
        assert words in text, (words, text)
    assert f"{rows['bf16']['ratio lo']:.2f}" in text and f"{rows['bf16']['ratio hi']:.2f}" in text
    assert not rankings(text.replace(gpu_files.say("gpu_files.steady_rule", band=5), ""), lang)[2:]  # two verdicts


# --------------------------------------------------------------------------- chapters 5 and 8, their own sentences


def markdown_around(number: str, lang: str, call: str) -> str:
    """The markdown cells just before and after the code cell that makes `call`, in a chapter of either edition."""
    import nbformat
    folder = BOOK / ("ja" if lang == "ja" else "")
    cells = nbformat.read(next(folder.glob(f"{number}_*.ipynb")), as_version=4).cells
    at = next(i for i, cell in enumerate(cells) if cell.cell_type == "code" and call in cell.source)
    return "\n".join(cell.source for cell in (cells[at - 1], cells[at + 1]) if cell.cell_type == "markdown")


def chapter_5_prose(lang: str, amp: BenchResult, cuda: bool, capability, monkeypatch) -> list[str]:
    """What chapter 5's own speed cells print (the table's paragraph, its own sweep on the H200, NVIDIA's figure,
    its "What to remember") when its live sweep gave `amp` on a machine with or without CUDA: the chapter's code
    cells, run as they are, in the edition `lang`, with everything they read from earlier cells given."""
    import matplotlib
    import nbformat

    from maskrcnn_tut.lab import speed_findings
    from maskrcnn_tut.lab.stored import across_builds
    matplotlib.use("Agg")
    folder = BOOK / ("ja" if lang == "ja" else "")
    cells = [cell.source for cell in nbformat.read(next(folder.glob("05_*.ipynb")), as_version=4).cells
             if cell.cell_type == "code"]
    wanted = ("measured = [row for row", "ranked = not cuda", "bench.gpu_files.chapter5_h200()", "book.PUBLISHED_AMP",
              '"ch05.remember"')
    said = []
    monkeypatch.setattr(book, "prose", said.append)
    namespace = {"amp": amp, "cuda": cuda, "capability": capability, "book": book, "bench": bench, "wording": wording,
                 "speed_findings": speed_findings, "across_builds": across_builds, "underflow_unscaled": "1 %",
                 "underflow_scaled": "0 %", "z": {"scaler off": 4.0, "steps": 4}}
    for marker in wanted:
        source = next(cell for cell in cells if marker in cell)
        exec(compile(source, f"chapter 5 ({marker})", "exec"), namespace)  # noqa: S102 (the chapter's own cell)
    return said


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_chapter_5_says_what_the_h200_measured_and_ranks_nothing(lang, h200_only, monkeypatch):
    """H1 (book-review-3): on a GPU, chapter 5's sentences on the H200's rows (its live sweep's, as a hub
    reader's first run would give, the committed file's, its own sweep of that day) rank no precision."""
    wording.set_language(lang)
    _, parts, _ = load_suite(h200_only / H200.name)
    monkeypatch.setattr(book, "RESULTS", h200_only)
    speed, own_sweep, published, remember = chapter_5_prose(lang, parts["amp"], True, (9, 0), monkeypatch)
    text = "\n".join([speed, own_sweep, published, remember])
    assert rankings(text, lang) == []
    # what was measured, with its steps, warm-up and source: the file's windows and the chapter's own run
    assert "19, 5, 6" in speed and "2.11.0+cu130" in own_sweep and "docs/measurements.md" in own_sweep
    fp16_range = {"en": "2.28-2.71", "ja": "2.28〜2.71"}[lang]  # the Japanese edition writes a range with 〜
    assert "9.16" in own_sweep and fp16_range in own_sweep and " 5 " in own_sweep  # 5 of 8 batches met a new shape
    assert LABEL[lang] in remember  # the committed file's label, in "What to remember"
    low, high = book.PUBLISHED_AMP["low"], book.PUBLISHED_AMP["high"]
    assert f"{low:.2f}" in published and f"{high:.2f}" in published  # NVIDIA's own figure beside them


def test_chapter_5_ranks_a_cpus_rows_whose_ranges_lie_apart(monkeypatch):
    """The same cells on a CPU's sweep do rank, so the test above would catch a ranking."""
    rows = [{"setting": "fp32 (no autocast)", "img/s": 10.0, "img/s lo": 9.8, "img/s hi": 10.2, "steps": 8, "peak MiB/device": 9},
            {"setting": "bf16 autocast", "img/s": 14.0, "img/s lo": 13.7, "img/s hi": 14.3, "steps": 8, "peak MiB/device": 8}]
    speed, *_ = chapter_5_prose("en", BenchResult("amp", "AMP", rows, ["setting", "img/s"]), False, None, monkeypatch)
    assert "faster than fp32" in speed and rankings(speed, "en")


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_chapter_8_sentences_on_the_gpu_files_rank_nothing(lang, h200_only, monkeypatch, capsys):
    """M4 (book-review-3): chapter 8's own words about the committed GPU files, and the file as it shows it."""
    wording.set_language(lang)
    prose = markdown_around("08", lang, "bench.show_gpu_results(book.RESULTS)")
    assert len(prose) > 200
    text = prose + "\n" + shown_text(monkeypatch, capsys, h200_only, None)
    assert rankings(text, lang) == []
    assert "hung" not in text and "median of 10 measured steps" in text if lang == "en" else True
