"""The lab's own sentences in the Japanese edition: each module's prose functions, called with the
inputs their English tests use, answer in Japanese, keep every number the English answer has and
none of the English template's words; and every catalog in prose/ has both languages with the same
placeholders. English is what the other lab tests check."""
from __future__ import annotations

import json
import re

import pytest
from test_findings import _cpu_table, _measured, _spread

from maskrcnn_tut.lab import (
    after_course,
    article,
    dataparallel,
    health,
    machine_findings,
    memory,
    preflight,
    scale_findings,
    traces,
    wording,
)
from maskrcnn_tut.lab.stored.result import BenchResult
from maskrcnn_tut.lab.wording import FASTER, SLOWER, WITHIN_NOISE, english, shown

#: The lab modules whose prose is `wording.say("<module>.<entry>")` of prose/<module>.json.
MODULES = ("machine_findings", "scale_findings", "health", "preflight", "traces", "article", "dataparallel",
           "after_course", "memory")
JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
#: What is no English word to translate: code spans, quoted messages, fields, flags, dotted or
#: underscored names (`pin_memory`, `requirements.txt`, `nvidia-smi`).
CODE = re.compile(r"`[^`]*`|(?<![A-Za-z])'[^']*'|\{[^{}]*\}|--[\w-]+|\w+(?:[_./=:-]\w+)+")
#: Lowercase names that the Japanese keeps as they are: tools, formats and code (forward and backward are
#: 順伝播 and 逆伝播, book/ja/glossary.md).
KEPT = {"machine_findings": {"loss", "torchvision"}, "scale_findings": {"gloo", "nccl"},
        "preflight": {"desync", "docker", "torch", "torchrun"}, "traces": {"torch"},
        "article": {"gloo", "numpy", "pillow", "torchrun", "torchvision", "wheel"},
        "after_course": {"counts", "height", "json", "size", "torchvision", "width"},
        "memory": {"autocast", "autograd", "float", "step"}}


def _words(text: str) -> set[str]:
    return {word for word in re.findall(r"[A-Za-z]+", CODE.sub(" ", text)) if len(word) >= 4 and word.islower()}


def english_words(module: str) -> set[str]:
    """The lowercase English words of the module's catalog, less the names the Japanese keeps."""
    return set().union(*(_words(entry["en"]) for entry in wording.catalog(module).values())) - KEPT.get(module, set())


def _text(value) -> str:
    """A result's words: strings, and the values (not the keys) of dicts and lists, joined."""
    if isinstance(value, dict):
        return "\n".join(_text(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return "\n".join(_text(item) for item in value)
    return "" if value is None else str(value)


@pytest.fixture
def ja():
    """The book in Japanese; English restored afterwards."""
    wording.set_language("ja")
    yield
    wording.set_language("en")


def both(call):
    """`call()` in English, then in Japanese (the fixture restores English at the end)."""
    wording.set_language("en")
    en = call()
    wording.set_language("ja")
    return en, call()


def assert_japanese(module: str, en, ja, values: tuple[str, ...] = ()) -> None:
    """`ja` is Japanese, holds every number of `en` and none of the module's English words
    (`values`: English that came in with the inputs, such as a row's label, is left out)."""
    en_text, ja_text = _text(en), _text(ja)
    assert JAPANESE.search(ja_text), ja_text
    for value in values:
        ja_text = ja_text.replace(value, " ")
    assert not english_words(module) & _words(ja_text), (english_words(module) & _words(ja_text), ja_text)
    assert not set(NUMBER.findall(en_text)) - set(NUMBER.findall(_text(ja))), (en_text, _text(ja))


# --------------------------------------------------------------------------- machine_findings


@pytest.mark.parametrize("per_kind", [None, {"fixed": (FASTER, SLOWER), "varying": (WITHIN_NOISE, SLOWER)},
                                       {"fixed": (FASTER, FASTER)}])
def test_benchmark_verdict(ja, per_kind):
    assert_japanese("machine_findings", *both(lambda: machine_findings.benchmark_verdict({"benchmark": per_kind}, 8, 64)))


@pytest.mark.parametrize("gpus", [0, 1, 8])
@pytest.mark.parametrize("repeated, compiled", [(True, True), (False, False)])
def test_determinism_and_workers(ja, gpus, repeated, compiled):
    hw = {"gpus": [{}] * gpus, "cores": 16}
    assert_japanese("machine_findings", *both(lambda: machine_findings.determinism(hw, repeated, 4, compiled)))
    for workers in (1, 4):
        assert_japanese("machine_findings", *both(lambda: machine_findings.workers_and_cores(hw, workers)))


def test_autocast_tf32_and_first_run(ja):
    for ratio in (1.2, 0.8):
        assert_japanese("machine_findings", *both(lambda: machine_findings.autocast_small_images(ratio, 192, 84.4)))
    for capability in (None, (7, 0), (9, 0)):
        assert_japanese("machine_findings", *both(lambda: machine_findings.tf32(capability)))
    for ap50, losses in ((0.0, [3.0, 2.5]), (0.3, [3.0, 2.5]), (0.8, [2.0, 2.1])):
        en, found = both(lambda: machine_findings.first_run(ap50, losses))
        assert_japanese("machine_findings", en, found)
        assert found["fell"] == en["fell"]


# --------------------------------------------------------------------------- scale_findings


@pytest.mark.parametrize("warned, balanced_warned", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("processes, gpus", [(2, 0), (2, 1), (8, 8)])
def test_straggler_and_no_sync_words(ja, warned, balanced_warned, processes, gpus):
    found = {"warned": warned, "balanced warned": balanced_warned, "forward ratio": 1.37}
    balanced = {"batch per rank": [2] * processes}
    assert_japanese("scale_findings", *both(lambda: scale_findings.straggler_words(found, balanced, 1.2, processes,
                                                                                   gpus)))
    assert_japanese("scale_findings", *both(lambda: scale_findings.no_sync_check_words(gpus)))


@pytest.mark.parametrize("ddp, ceiling", [((1.6, 2.0), (1.7, 2.0)), ((1.75, 1.82), (1.88, 1.95)),
                                          ((0.9, 1.5), (1.7, 2.0)), ((2.1, 2.6), (1.7, 2.0)),
                                          ((1.95, 2.0), (1.75, 1.8))])
def test_table_verdicts_on_a_cpu(ja, ddp, ceiling):
    table = _cpu_table(ddp, ceiling)
    labels = tuple(row["setup"] for row in table.rows) + tuple(row["note"] for row in table.rows if "note" in row)
    assert_japanese("scale_findings", *both(lambda: scale_findings.table_verdicts(table)), labels)


@pytest.mark.parametrize("dp", [(4.6, 5.3), (7.5, 7.9), (7.1, 7.3)])
def test_table_verdicts_on_eight_gpus(ja, dp):
    eight = BenchResult("table", "t", [_spread(_measured("Single GPU", 1.0, 1), 1.0, 1.0),
                                       _spread(_measured("DP(8)", 5.0, 8), *dp),
                                       _spread(_measured("DDP(8)", 7.2, 8, processes=8), 7.0, 7.4)], [], [], {})
    assert_japanese("scale_findings", *both(lambda: scale_findings.table_verdicts(eight)), ("Single GPU",))


def test_table_verdicts_on_one_device_and_without_a_spread(ja):
    one = BenchResult("table", "t", [_measured("Single", 1.0, 1), {"setup": "DDP", "note": "x"}], [], [], {})
    assert_japanese("scale_findings", *both(lambda: scale_findings.table_verdicts(one)))
    rough = BenchResult("table", "t", [_measured("Single", 1.0, 1, 1), _measured("Threads", 1.3, 2, 2, 1),
                                       _measured("DDP(2)", 1.8, 2, 1, 2),
                                       _measured("2 processes without gradient all-reduce", 1.9, 2, 1, 2)], [], [], {})
    assert_japanese("scale_findings", *both(lambda: scale_findings.table_verdicts(rough)),
                    ("2 processes without gradient all-reduce",))


# --------------------------------------------------------------------------- health


def _rows(data_time: float, memory_mb: float) -> list[dict]:
    return [{"step": s, "data_time": data_time, "iter_time": 0.5, "img_per_s": 8.0, "max_mem_mb": memory_mb}
            for s in range(1, 5)]


@pytest.mark.parametrize("data_time, memory_mb", [(0.05, 100.0), (0.4, 950.0)])
def test_health_advice(ja, monkeypatch, data_time, memory_mb):
    monkeypatch.setattr(health, "gpu_name", lambda gpu: f"GPU {gpu['gpu']}")
    gpus = [{"gpu": 0, "util_mean": 40.0, "mem_used_max_mb": 500.0, "mem_total_mb": 1000.0},
            {"gpu": 1, "util_mean": 95.0, "mem_used_max_mb": 950.0, "mem_total_mb": 1000.0},
            {"gpu": 2, "util_mean": 80.0, "mem_used_max_mb": 900.0, "mem_total_mb": 1000.0}]
    for given in ({"total_memory_mb": 1000.0}, {"gpus": gpus}):
        en, found = both(lambda: health.health_advice(_rows(data_time, memory_mb), **given))
        assert [c.ok for c in found.checks] == [c.ok for c in en.checks]
        assert_japanese("health", [str(en), en._repr_markdown_()], [str(found), found._repr_markdown_()])
    monkeypatch.setattr(health, "device_memory_mb", lambda device: None)
    assert_japanese("health", *both(lambda: str(health.health_advice(_rows(data_time, memory_mb)))))


# --------------------------------------------------------------------------- preflight


def shown_rows(rows) -> list[dict]:
    """A lab function's rows as a chapter shows them: its recorded sentences worded in the book's language."""
    return [{key: shown(value) for key, value in row.items()} for row in rows]


def test_preflight_findings(ja, monkeypatch, tmp_path):
    """preflight records its findings in English (`wording.english`: a build's Japanese chapter reads back what
    the English one measured); shown, they are Japanese."""
    assert_japanese("preflight", *both(lambda: shown_rows([preflight.shm_report(tmp_path / "nope")])))
    monkeypatch.setattr(preflight.os, "statvfs", lambda path: type("S", (), {"f_blocks": 16384, "f_frsize": 4096,
                                                                              "f_bavail": 8192})())
    monkeypatch.setattr(preflight, "MIN_SHM_MB", 1024)
    assert_japanese("preflight", *both(lambda: shown_rows([preflight.shm_report(tmp_path)])))
    wording.set_language("ja")
    assert str(preflight.shm_report(tmp_path)["finding"]).isascii()  # recorded in English, whatever the language
    assert_japanese("preflight", *both(lambda: preflight.nccl_environment({"NCCL_DEBUG": "INFO"})))
    monkeypatch.setattr(preflight.processes, "launch", lambda *args, **kwargs: [
        {"MB": 64.0, "ms": 12.345, "bus GB/s": 5.4321, "backend": "gloo"}])
    for gpus in ([], [{"gpu": 0, "ok": True, "finding": "fine"}, {"gpu": 1, "ok": False, "finding": "ECC"}]):
        monkeypatch.setattr(preflight, "gpu_health", lambda gpus=gpus: gpus)
        en, found = both(lambda: shown_rows(preflight.preflight(2)[0]))
        assert [row["ok"] for row in found] == [row["ok"] for row in en]
        assert_japanese("preflight", en, found)
    diagnosis = {"ranks": [{"rank": 0, "waiting in a collective": True, "collective": "all_reduce",
                            "function": "train_loop", "file": "train.py"},
                           {"rank": 1, "waiting in a collective": False, "collective": None,
                            "function": "stalled_step", "file": "preflight.py"}]}
    assert_japanese("preflight", *both(lambda: preflight.hang_summary(diagnosis)))


# --------------------------------------------------------------------------- traces


def test_trace_table_and_sentences(ja, monkeypatch):
    step = {"gradient all-reduces": 3, "step ms": 100.0, "data ms": 1.0, "forward ms": 30.0, "backward ms": 50.0,
            "optimizer ms": 5.0, "waiting ms": 14.0, "all-reduce ms": 0.0, "all-reduce during backward ms": 2.0}
    trace = traces.DDPTrace(steps={phase: [[step, step]] for phase in traces.PHASES}, bucket_cap_mb=100.0,
                            batch_size=8)
    assert_japanese("traces", *both(lambda: [row["run"] for row in trace.table()]))
    assert_japanese("traces", *both(lambda: traces.buffer_sync_words(3)))
    monkeypatch.setattr(traces, "hardware", lambda: {"cpu": "Intel Xeon"})
    assert_japanese("traces", *both(lambda: shown(traces.cpu_label(2))))
    label = traces.cpu_label(2)  # recorded in English; passed to a sentence, worded in the book's language
    assert str(label).isascii() and shown(label) in wording.say("scale_findings.includes_one", within=label)


# --------------------------------------------------------------------------- article and dataparallel


def test_stack_and_recipe(ja):
    report = [{"": "PyTorch / torchvision", "this machine": "2.9 / 0.24"}, {"": article.CUDA_ROW, "this machine": "12.8"},
              {"": "GPUs", "this machine": "none"}, {"": "NCCL", "this machine": "2.27"},
              {"": "distributed backends", "this machine": "gloo"}, {"": "Python", "this machine": "3.11"}]
    assert_japanese("article", *both(lambda: article.stack_today(report)), ("none",))
    en, found = both(article.reference_recipe)
    assert [row["same"] for row in found] == [row["same"] for row in en]  # compared in the book's language
    assert_japanese("article", en, found, ("GroupNorm",))
    assert_japanese("article", *both(lambda: [wording.term(key) for key in (
        "Mask R-CNN (5 losses)", "toy detector (2 losses)", "toy, losses = model(...) (the loss dict)", "no error")]))


@pytest.mark.parametrize("gpus", [0, 1])
def test_dataparallel_unavailable(ja, gpus):
    assert_japanese("dataparallel", *both(lambda: dataparallel.explain_unavailable(gpus)))


# --------------------------------------------------------------------------- after_course


def test_after_course(ja, tmp_path):
    import numpy as np
    from pycocotools import mask as mask_utils

    gt = tmp_path / "gt.json"
    gt.write_text(json.dumps({"categories": [{"id": 7, "name": "kite"}]}))
    pixels = np.zeros((20, 20), dtype=np.uint8, order="F")
    pixels[5:15, 5:15] = 1
    rle = mask_utils.encode(pixels)
    rle["counts"] = rle["counts"].decode()
    for category in (7, 9):
        result = {"image_id": 1, "category_id": category, "bbox": [1, 2, 3, 4], "score": 0.9, "segmentation": rle}
        en, found = both(lambda: after_course.explain_result(result, gt))
        assert [row["field"] for row in found] == list(after_course.RESULT_FIELDS)
        assert_japanese("after_course", [[row["value"], row["meaning"]] for row in en],
                        [[row["value"], row["meaning"]] for row in found], ("kite",))

    def failure(call):
        try:
            call()
        except (RuntimeError, ValueError) as err:
            return str(err)
    assert_japanese("after_course", *both(lambda: failure(lambda: after_course.run_cli(lambda args: 3, "x.py", []))))
    assert_japanese("after_course", *both(lambda: failure(lambda: after_course.overfit_check([1.0]))))
    assert_japanese("after_course", *both(lambda: [wording.term(check) for check in (
        "pycocotools' loadRes reads detections.json", "every detection's image is listed in images.json",
        "every category_id is one of the training json's", "every mask has its image's height and width")]))


# --------------------------------------------------------------------------- memory


def test_memory_table_is_stored_in_english_and_shown_in_japanese(ja, monkeypatch):
    monkeypatch.setattr(memory, "provenance", lambda call: {"hardware": "hw"})
    monkeypatch.setattr(memory, "breakdown", lambda cfg, size, batch, device=None: memory.MemoryBreakdown(
        "cpu-tiny", size, batch, "cpu", "off (fp32)", 10.0, 10.0, 20.0, 0.5 * size * size / 1e4, 50))
    wording.set_language("ja")
    result = memory.memory_table("cpu-tiny", image_sizes=(96, 128, 192), batch_sizes=(1, 2), measure_sizes=(96, 128))
    assert {row["activations"] for row in result.rows} == {"counted", "extrapolated"}  # what is stored
    assert "extrapolated" in result.notes[1]
    en, found = both(result.to_markdown)
    assert_japanese("memory", en, found, ("cpu-tiny", "adamw", "px"))


@pytest.mark.parametrize("entry, values", [
    ("title_table", {"backbone": "resnet50"}), ("title_bytes", {"backbone": "resnet50"}),
    ("counted", {"preset": "gpu-r50", "backbone": "resnet50", "autocast": "float16", "optimizer": "sgd",
                 "sizes": "192 px, 320 px", "device": "cuda"}),
    ("fit", {"intercept": 120.0, "slope": 310.0}), ("fits", {"gb": 11.0}), ("cpu_fp32", {}),
    ("derived", {"preset": "gpu-r50", "backbone": "resnet50", "count": 44401393, "device": "cpu", "size": 96}),
    ("amp_fixed", {})])
def test_memory_notes_read_back_into_japanese(ja, entry, values):
    stored = english(f"memory.{entry}", **values)
    assert shown(stored) == wording.say(f"memory.{entry}", **values)
    assert_japanese("memory", stored, shown(stored), ("resnet", "sgd", "cuda", "cpu", "px"))


# --------------------------------------------------------------------------- every catalog


def test_every_catalog_has_both_languages_with_the_same_placeholders():
    catalogs = wording.catalog_names()
    assert set(MODULES) <= set(catalogs) and {f"ch{n:02d}" for n in range(13)} <= set(catalogs)
    for catalog in catalogs:
        entries = wording.catalog(catalog)
        if catalog == "terms":  # English -> Japanese, flat
            assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in entries.items()), catalog
            continue
        for name, entry in entries.items():
            assert all(isinstance(entry.get(lang), str) for lang in wording.LANGUAGES), (catalog, name)
            assert entry["ja"] or not entry["en"].strip(), (catalog, name)  # only a separator may be empty
            assert wording.placeholders(entry["en"]) == wording.placeholders(entry["ja"]), (catalog, name)


def test_the_core_straggler_warning_is_shown_in_japanese(ja):
    """monitor.StragglerCheck words its warning in English, once (the core has no wording), and keeps its
    figures; a chapter's table words the same figures in Japanese through bench.json's entry."""
    from maskrcnn_tut.engine import StepRecord
    from maskrcnn_tut.monitor import StragglerCheck

    check = StragglerCheck(every=3, threshold=1.2)
    for step in range(1, 4):
        check(StepRecord(step=step, epoch=0, lr=0.1, loss=1.0, terms={}, data_time=0.0, iter_time=1.0,
                         rank_forward_times=[0.1, 0.1, 0.16]))
    stored = wording.Said("bench.straggler_warning", check.found[0], english=check.warnings[0])
    assert str(stored) == check.warnings[0] and "rank 2 needed 1.60x" in stored
    assert shown(stored) == wording.say("bench.straggler_warning", slow=2, ratio=1.6, first=1, last=3,
                                        slow_s=0.16, median_s=0.1)
    assert "1.60" in shown(stored) and "0.160" in shown(stored)
    assert_japanese("bench", stored, shown(stored), ("forward", "all-reduce", "distributedsampler", "cpu"))
