"""TensorBoard is optional: without the package the metrics logger warns once and writes
metrics.jsonl alone (hub images and `--no-deps` installs often lack it)."""
from __future__ import annotations

import logging
import sys

import torch

from maskrcnn_tut.engine import StepRecord
from maskrcnn_tut.monitor import MetricsLogger, read_jsonl


def test_logger_without_tensorboard_warns_once_and_writes_jsonl(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    with caplog.at_level(logging.WARNING, logger="maskrcnn_tut"):
        logger = MetricsLogger(tmp_path, 4, 0, 8, torch.device("cpu"), print_freq=2, progress=False)
        for step in range(1, 5):
            logger(StepRecord(step=step, epoch=0, lr=0.1, loss=1.0, terms={}, data_time=0.1, iter_time=1.0))
        logger.log_eval(4, {"bbox_AP": 0.5})
        logger.close()
    warnings = [r.getMessage() for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(warnings) == 1 and "metrics.jsonl" in warnings[0]
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4]
    assert not (tmp_path / "tensorboard").exists()
