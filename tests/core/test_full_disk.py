"""A disk that fills up under a run's logs costs no steps and leaves no half row: metrics.jsonl keeps
its rows until they can be written (one warning), TensorBoard gives way to metrics.jsonl (one
warning, no thread traceback), and a resume drops a half-written row with a line instead of failing."""
from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from disks import tmpfs

from maskrcnn_tut import rundir
from maskrcnn_tut.engine import StepRecord
from maskrcnn_tut.monitor import MetricsLogger, read_jsonl


def _step(step: int) -> StepRecord:
    terms = {f"loss_{k}": 0.1 for k in range(8)}  # rows and scalars the size of a real run's
    return StepRecord(step=step, epoch=0, lr=0.1, loss=1.0, terms=terms, data_time=0.1, iter_time=1.0)


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_metrics_jsonl_on_a_full_disk_warns_once_keeps_whole_rows_and_loses_none(tmp_path, caplog):
    with tmpfs(tmp_path / "disk", "8k") as out, caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        (out / "other files").write_bytes(b"\0" * 4096)
        logger = MetricsLogger(out, 200, 0, 8, torch.device("cpu"), print_freq=1, progress=False, tensorboard=False)
        step = 0
        while not _warnings(caplog, "cannot be written"):
            step += 1
            assert step < 200, "4 KiB should fill up long before 200 rows"
            logger(_step(step))
        full_at = step
        text = (out / "metrics.jsonl").read_text()
        assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())  # no half row
        for step in range(full_at + 1, full_at + 4):
            logger(_step(step))  # the run goes on; its rows wait
        (out / "other files").unlink()  # space returns
        logger(_step(full_at + 4))
        logger.close()
        assert len(_warnings(caplog, "cannot be written")) == 1 and not _warnings(caplog, "could not be written")
        assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, full_at + 5))


@pytest.mark.parametrize("when", ["at start", "mid-run"])
def test_tensorboard_on_a_full_disk_gives_way_to_metrics_jsonl_with_one_warning(when, tmp_path, caplog, monkeypatch):
    out = tmp_path / "run"
    thread_failures = []  # what would print a thread's traceback
    monkeypatch.setattr(threading, "excepthook", thread_failures.append)
    with tmpfs(out / "tensorboard", "12k") as board, caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        if when == "at start":
            (board / "filler").write_bytes(b"\0" * 12 * 1024)
        logger = MetricsLogger(out, 100, 0, 8, torch.device("cpu"), print_freq=1, progress=False)
        for step in range(1, 101):
            logger(_step(step))
        logger.log_eval(100, {"bbox_AP": 0.5})
        logger.close()
        warnings = _warnings(caplog, "tensorboard")
        assert len(warnings) == 1 and "cannot be written (No space left on device)" in warnings[0], warnings
        assert "metrics go to metrics.jsonl only" in warnings[0]
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == list(range(1, 101))
    assert read_jsonl(out / "eval.jsonl") == [{"step": 100, "bbox_AP": 0.5}]
    assert not thread_failures  # the writer thread's failure is the warning, not a traceback


def test_a_resume_drops_a_half_written_row_with_a_warning(tmp_path, caplog):
    rows = [json.dumps({"step": step, "loss": 1.0}) for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        assert rundir.drop_replayed_rows(tmp_path, 2) == 1
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}]
    assert _warnings(caplog, "dropped 1 line(s) that are no whole JSON row (line 4")


def _compiler_cannot_write(full) -> None:
    """What torch.compile raised when g++ could not write its temporary file into a full TMPDIR."""
    from torch._inductor import exc

    output = f"cpp_prefix.h:1508:2: fatal error: error closing {full}/ccs8pRFK.s: No space left on device"
    try:
        raise exc.CppCompileError(["g++", "-x", "c++-header", "prefix.h"], output + "\ncompilation terminated.")
    except exc.CppCompileError as err:
        if not hasattr(exc, "InductorError"):  # torch < 2.7 raised the compiler's error itself
            raise
        raise exc.InductorError(err, None) from err


@pytest.mark.parametrize("fault", ["compiler", "cache-write"])
def test_a_full_tmp_is_one_line(fault, tmp_path, monkeypatch, capsys):
    """`/tmp` full (issue 36 probe): train.py with --compile-backbone ended in a 100-line traceback from
    torch.compile at its first step (g++'s temporary files live in TMPDIR, so do compiled kernels without
    TORCHINDUCTOR_CACHE_DIR). Without --compile-backbone, training and predict write nothing there."""
    from maskrcnn_tut import distributed as du

    with tmpfs(tmp_path / "tmp", size="16k") as full:
        monkeypatch.setenv("TMPDIR", str(full))

        def first_step():
            if fault == "compiler":
                _compiler_cannot_write(full)
            (full / "kernel.py").write_text("x" * 100_000)  # inductor writing a kernel's code

        code = du.run_cli(first_step)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: a disk is full (") and f"TMPDIR (now {full};" in line, line
    if fault == "compiler":
        assert f"(error closing {full}/ccs8pRFK.s: No space left on device)" in line, line
