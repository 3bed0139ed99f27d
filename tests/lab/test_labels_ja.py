"""The Japanese edition's words from the lab's display modules: under `set_language("ja")` the hardware
summary, one plot of each plotting module and the benchmark tables come out in Japanese, with the
same numbers as in English, and Japanese plots draw without a missing glyph.
"""
from __future__ import annotations

import re
import warnings

import matplotlib
import pytest

from maskrcnn_tut.lab import book, dashboard, diagrams, timeline, trace_plots, wording
from maskrcnn_tut.lab.bench import projection
from maskrcnn_tut.lab.stored.result import BenchResult
from maskrcnn_tut.lab.traces import DATA, FORWARD, STEP, DDPTrace
from maskrcnn_tut.lab.wording import english

HARDWARE = {"cpu": "AMD EPYC 7B13", "cores": 2, "ram_gb": 7.8, "gpus": [], "gpu_memory_gb": []}
#: Words that must not be left in a Japanese label (they are in the English ones).
ENGLISH = re.compile(r"\b(the|of|per|and|step|steps|memory|devices?|usable|machine|peak|median|rank|process)\b")


@pytest.fixture
def both():
    """Run a function in English, then in Japanese (font and all); the language is English after."""
    def run(fn):
        import matplotlib.pyplot as plt
        out = {}
        for lang in ("en", "ja"):
            with matplotlib.rc_context():
                book.set_language(lang)
                out[lang] = fn()
                if isinstance(out[lang], matplotlib.figure.Figure):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        out[lang].canvas.draw()
                    missing = [str(w.message) for w in caught if "missing from" in str(w.message)]
                    assert not missing, missing
                    text = texts(out[lang])
                    plt.close(out[lang])
                    out[lang] = text
        return out
    yield run
    wording.set_language("en")


def texts(fig) -> list[str]:
    """Every title, axis label, legend entry, tick label and annotation of a figure."""
    found = [fig._suptitle.get_text()] if fig._suptitle else []
    for ax in fig.axes:
        found += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        found += [t.get_text() for t in ax.texts]
        found += [t.get_text() for t in ax.get_yticklabels()]
        legend = ax.get_legend()
        found += [t.get_text() for t in legend.get_texts()] if legend else []
    found += [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    return [t for t in found if t]


def numbers(text) -> list[str]:
    """The figures in a text, but 1: Japanese counts "one device" or "per step" as 1 デバイス, 1 ステップあたり."""
    found = re.findall(r"\d+(?:\.\d+)?", " ".join(text) if isinstance(text, list) else text)
    return sorted(number for number in found if number != "1")


def japanese(text: str) -> bool:
    return bool(re.search(r"[\u3040-\u30ff\u4e00-\u9fff]", text))


def captured_markdown(monkeypatch) -> list[str]:
    import IPython.display
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objects, **_: shown.extend(o.data for o in objects))
    return shown


# --------------------------------------------------------------------------- the hardware summary


def test_hardware_summary_table_and_paragraph(both, monkeypatch):
    monkeypatch.setattr(book, "hardware", lambda: dict(HARDWARE))
    monkeypatch.setattr(book, "default_preset", lambda: "cpu-tiny")
    tables = captured_markdown(monkeypatch)

    def summary():  # the table, then the paragraph, both displayed as markdown
        book.hardware_summary()
        table, text = tables[-2:]
        del tables[-2:]
        return table, text

    said = both(summary)
    (en_table, en_text), (ja_table, ja_text) = said["en"], said["ja"]
    assert "| | this machine |" in en_table.replace("|  |", "| |") and "2 usable cores" in en_table
    assert "このマシン" in ja_table and "使えるコア 2 個" in ja_table and "プリセット" in ja_table
    assert "プロセスあたりバッチ" in ja_table and not ENGLISH.search(ja_table.replace("AMD EPYC", ""))
    assert numbers(ja_table) == numbers(en_table)
    assert en_text.startswith("No GPU: every chapter runs its CPU analogue")
    assert ja_text.startswith("GPU がありません。") and "gpu-r50" in ja_text and "every chapter" not in ja_text


# --------------------------------------------------------------------------- one plot per module


def speed_table() -> BenchResult:
    rows = [{"setup": english("bench.single_thread", threads=1), "processes": 1, "img/s": 3.21, "peak MiB/device": 812,
             "speedup": 1.0, "scaling efficiency": 1.0, "note": english("bench.baseline"), "data ms": 1.5,
             "compute ms": 620.0},
            {"setup": "DP(2)", "processes": 1, "note": "DataParallel needs >= 2 GPUs"},
            {"setup": english("bench.ddp_thread", n=2, threads=1), "processes": 2, "img/s": 5.87, "peak MiB/device": 790,
             "speedup": 1.83, "scaling efficiency": 0.914, "data ms": 2.5, "compute ms": 680.0}]
    notes = [english("bench.table_setup", preset="cpu-tiny", backbone="resnet18", min_size=128, batch=8, unit="process",
                     steps=12, warmup=2),
             english("bench.table_shared_cores", n=2, cores=2), english("bench.table_speedup")]
    return BenchResult("table", english("bench.table_title"), rows, ["setup", "processes", "img/s", "peak MiB/device",
                       "speedup", "scaling efficiency", "note"], notes,
                       {"hardware": english("provenance.label_cpu", cores=2, cpu="AMD EPYC 7B13")})


def test_book_plots(both):
    said = both(lambda: book.line_plot([1, 2], {"compute": [1.0, 2.0]}, "Throughput", "step", "images / s"))
    assert said["ja"][0].startswith("スループット\n") and {"ステップ", "画像 / 秒", "計算"} <= set(said["ja"])
    said = both(lambda: book.plot_data_vs_compute(speed_table()))
    assert said["ja"][0] == "速度表：1 デバイス、DataParallel と DDP\nGPU なしの 2 コア AMD EPYC 7B13"
    assert "1 ステップあたりのミリ秒（中央値）" in said["ja"] and "データ（データローダ待ち）" in said["ja"]
    assert "シングル（1 プロセス × 1 スレッド）" in said["ja"] and numbers(said["ja"]) == numbers(said["en"])


def test_bench_plots(both):
    said = both(lambda: speed_table().plot())
    assert said["en"][0] == "Speed table: one device, DataParallel and DDP — 2-core AMD EPYC 7B13 (no GPU)"
    assert said["ja"][0] == "速度表：1 デバイス、DataParallel と DDP — GPU なしの 2 コア AMD EPYC 7B13"
    assert {"スループット", "画像 / 秒（ステップの中央値）", "デバイスあたりのピークメモリ"} <= set(said["ja"])
    assert "DDP(2)（2 プロセス × 1 スレッド）" in said["ja"] and numbers(said["ja"]) == numbers(said["en"])
    paper = projection.predict(0.5, 40e6, counts=(1, 2, 4), backward_share=0.6)
    said = both(lambda: projection.plot_scaling(None, paper, "Measured scaling", published=None))
    assert said["ja"][:3] == ["Measured scaling", "デバイス数（GPU。CPU では 1 コアのプロセス）",
                              "スケーリング効率（1 デバイスの N 倍に対する %）"]
    assert "理論値：PCIe 3.0 約 12 GB/s（RTX 2080 Ti）、InfiniBand NIC あたり約 25 GB/s（帯はオーバーラップの最良ケースまで）" \
        in said["ja"] and numbers(said["ja"]) == numbers(said["en"])


def test_dashboard_plot(both):
    rows = [{"step": s, "data_time": 0.1, "iter_time": 0.5, "img_per_s": 8.0, "max_mem_mb": 100.0} for s in (1, 2, 3)]
    said = both(lambda: dashboard.plot_metrics(rows, total_memory_mb=1000.0))
    assert said["ja"][0].startswith("学習ステップ — ")
    assert {"1 ステップの時間の内訳", "1 ステップの秒数", "スループット", "画像 / 秒", "ピークメモリ", "中央値 8.00",
            "1000 MiB の 90%"} <= set(said["ja"])
    assert numbers(said["ja"]) == numbers(said["en"])


def test_timeline_plot(both):
    def plot():
        label = wording.say("timeline.label", batch=8, accum=1, precision="fp32")  # the default label
        points = [(0.0, 0.0, 0.0, "data"), (5.0, 300.0, 0.0, "RPN"), (9.0, 120.0, 40.0, "backward")]
        return timeline.plot_memory_timelines([timeline.MemoryTimeline(label, 8, 1, "fp32", 40.0, 80.0, points)],
                                              "Peak memory", "2-core CPU")

    said = both(plot)
    assert "ピーク 420 MiB\n（RPN）" in said["ja"] and "ステップ開始からの ms" in said["ja"]
    assert "バッチ 8 × 累積 1、fp32" in said["ja"] and {"パラメータ", "オプティマイザの状態", "勾配"} <= set(said["ja"])
    assert "保持している MiB" in said["ja"] and said["ja"][0].startswith("ピークメモリ\n")
    assert numbers(said["ja"]) == numbers(said["en"])
    assert timeline.MemoryTimeline("x", 8, 1, "fp32", 1.0, 1.0, [(0.0, 1.0, 1.0, "backward")]).peak[3] == "backward"


def test_diagrams(both):
    said = both(lambda: diagrams.draw_dataparallel_vs_ddp(devices=2))
    assert said["ja"][0].startswith("1 回の学習ステップ：DataParallel は重み、出力、勾配を")
    assert "DistributedDataParallel（GPU ごとに 1 プロセス）" in said["ja"] and "プロセス 1" in said["ja"]
    said = both(lambda: diagrams.draw_ring_allreduce(3))
    assert said["ja"][0].startswith("3 ランクのリング all-reduce：") and "ランク 2" in said["ja"]
    assert all(japanese(t) for t in said["ja"] if ENGLISH.search(t))


def fake_trace() -> DDPTrace:
    row = {"step span": (0.0, 100_000.0), "backward spans": [(40_000.0, 70_000.0)], "backward span": (40_000.0, 70_000.0),
           "grad spans": [(55_000.0, 60_000.0), (70_000.0, 80_000.0)], "bucket launches": [55_000.0, 70_000.0],
           "bucket MiB": [24.5, 20.3]}
    events = [{"name": STEP, "ph": "X", "tid": 1, "ts": 0.0, "dur": 100_000.0},
              {"name": DATA, "ph": "X", "tid": 1, "ts": 1_000.0, "dur": 5_000.0},
              {"name": FORWARD, "ph": "X", "tid": 1, "ts": 6_000.0, "dur": 30_000.0},
              {"name": "Optimizer.step#SGD.step", "ph": "X", "tid": 1, "ts": 85_000.0, "dur": 5_000.0}]
    return DDPTrace({"ddp_small_buckets": [[row], [row]]}, 25.0, 2, {"ddp_small_buckets": [events, events]},
                    "2 CPU processes")


def test_trace_plots(both):
    said = both(lambda: trace_plots.plot_buckets(fake_trace()))
    assert said["ja"][0].startswith("勾配のバケット（上限 25 MB）：") and "逆伝播の開始からのミリ秒" in said["ja"]
    assert " バケット 1 の準備完了：24.5 MiB" in said["ja"] and numbers(said["ja"]) == numbers(said["en"])
    said = both(lambda: trace_plots.plot_steps(fake_trace(), ("ddp_small_buckets",), "Overlap"))
    assert "DDP(2)、上限 25 MB：バケット 2 個" in said["ja"] and "ランク 1" in said["ja"]
    assert {"データ", "順伝播", "オプティマイザ", "勾配の all-reduce（gloo スレッド）"} <= set(said["ja"])


# --------------------------------------------------------------------------- the bench tables


def test_bench_table_headers_and_notes(both):
    said = both(lambda: speed_table().to_markdown())
    en, ja = said["en"], said["ja"]
    assert "| setup | processes | img/s | peak MiB/device | speedup | scaling efficiency | note |" in en
    assert "| 構成 | プロセス数 | img/s | デバイスあたりのピーク MiB | 高速化率 | スケーリング効率 | 備考 |" in ja
    assert "| DDP(2)（2 プロセス × 1 スレッド） | 2 | 5.87 | 790 | 1.83 | 0.914 |" in ja
    assert "- 2 プロセスが使えるコア 2 個を共有し" in ja and "- 高速化率：最初の行に対する img/s の比。" in ja
    assert numbers(ja) == numbers(en)


def test_show_table_and_fits_table(both, monkeypatch):
    tables = captured_markdown(monkeypatch)
    memory = BenchResult("memory", "m", [{"image size": 512, "batch": b, "total MiB": 3000.0 * b} for b in (1, 2, 8)],
                         [], [], {})

    def shown():
        book.show_table(speed_table().rows, speed_table().columns)
        book.show_table(book.fits_table(memory, cards_gb=(2, 11, 80)))
        return tables[-2:]

    said = both(shown)
    (en_speed, en_fits), (ja_speed, ja_fits) = said["en"], said["ja"]
    assert en_fits.startswith("| image size | 2 GB card | 11 GB card | 80 GB card |\n")
    assert ja_fits.startswith("| 画像サイズ | 2 GB のカード | 11 GB のカード | 80 GB のカード |\n")
    assert "| 512 x 512 | none | batch 2 | batch 8 |" in en_fits and "| 512 x 512 | なし | バッチ 2 | バッチ 8 |" in ja_fits
    assert en_speed.startswith("| setup | processes |") and "| Single (1 process x 1 thread) | 1 |" in en_speed
    assert ja_speed.startswith("| 構成 | プロセス数 |") and "| シングル（1 プロセス × 1 スレッド） | 1 |" in ja_speed
    assert numbers(ja_fits) == numbers(en_fits)
    assert speed_table().rows[0]["setup"] == "Single (1 process x 1 thread)"  # the rows stay English


# --------------------------------------------------------------------------- sentences and what is recorded


def test_machine_words_follow_the_language_but_provenance_stays_english(both, monkeypatch):
    from maskrcnn_tut.lab import provenance
    monkeypatch.setattr(provenance, "hardware", lambda: dict(HARDWARE))
    said = both(lambda: (provenance.hardware_label(), provenance.environment_report(), provenance.provenance("x")["hardware"]))
    (en_label, en_report, en_prov), (ja_label, ja_report, ja_prov) = said["en"], said["ja"]
    assert en_label == en_prov == ja_prov == "2-core AMD EPYC 7B13 (no GPU)"
    assert ja_label == "GPU なしの 2 コア AMD EPYC 7B13"
    assert [row[""] for row in ja_report] == [row[""] for row in en_report]  # code reads the rows by these
    ja_cpu, en_cpu = ja_report[0]["this machine"], en_report[0]["this machine"]
    assert "使えるコア 2 個" in ja_cpu and "usable cores" in en_cpu and numbers(ja_cpu) == numbers(en_cpu)


def test_bench_and_gpu_sentences(both):
    from maskrcnn_tut.lab.nvml import GPUSampler
    from maskrcnn_tut.lab.stored.across_builds import describe_cache, machine_busy, spread_text
    busy = BenchResult("t", "t", [], [], [], {"cache": {"other load": 0.35, "hit": True, "measured": "2026-01-02T03:04",
                                                        "file": "/tmp/t.json"}})
    reading = [{"gpu": 0, "nvml_index": 3, "util": 30.0, "mem_used_mb": 4096.0, "mem_total_mb": 81920.0}]

    def sentences():
        with GPUSampler(reader=lambda: reading) as sampler:
            pass
        return [machine_busy(busy), describe_cache(busy), spread_text({"speedup": 1.9, "speedup lo": 1.7, "speedup hi": 2.1}),
                sampler.describe(), book.source_listing(fake_trace).split("\n")[0]]

    said = both(sentences)
    assert said["en"][2:4] == ["1.90x (IQR 1.70-2.10x)", "GPU 0 (nvidia-smi GPU 3): 30 % busy, 4096 of 81920 MiB at most "
                                                          "(1 samples)"]
    assert said["ja"][0].startswith("この計測の間、ほかのプロセスがこのマシンのコアの 35% を使っていた")
    assert said["ja"][1].startswith("キャッシュから読み込み（2026-01-02 03:04 UTC、`/tmp/t.json`。")
    assert said["ja"][2:4] == ["1.90 倍（四分位範囲 1.70〜2.10 倍）",
                               "GPU 0（nvidia-smi では GPU 3）：使用率 30%、メモリは最大 4096 / 81920 MiB（サンプル 1 個）"]
    assert said["ja"][4].startswith("`tests/lab/test_labels_ja.py`、") and said["ja"][4].endswith(" 行目：")
    assert [numbers(ja) for ja in said["ja"]] == [numbers(en) for en in said["en"]]
