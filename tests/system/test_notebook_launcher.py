"""processes.launch: 2 gloo processes from a test and from a notebook cell, errors, cleanup.

The worker functions below are importable by the spawned children because pytest puts tests/
on sys.path, which `spawn` hands down to them.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from maskrcnn_tut import distributed as du
from maskrcnn_tut.errors import WorkerError
from maskrcnn_tut.lab import processes

pytestmark = pytest.mark.system


def rank_and_pid(tag: str) -> list[dict]:
    info = du.info()
    print(f"{tag} from rank {info.rank}")
    return du.all_gather_objects({"rank": info.rank, "world": info.world_size, "pid": os.getpid(),
                                  "backend": info.backend})


def fail_on_rank_one() -> None:
    if du.info().rank == 1:
        raise ValueError("rank one is broken")
    du.barrier()  # rank 0 would wait here until the process-group timeout: launch must stop it


def exit_hard_on_rank_one() -> None:
    if du.info().rank == 1:
        os._exit(3)
    du.barrier()


def return_unpicklable() -> threading.Lock:
    return threading.Lock()


def load_with_workers() -> list[int]:
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1)
    return [int(x) for batch in loader for x in batch]


def _no_children_left() -> bool:
    return multiprocessing.active_children() == []


def test_two_processes_return_rank_zeros_result_and_stream_output(capsys):
    gathered = processes.launch(rank_and_pid, 2, "hello")
    assert [g["rank"] for g in gathered] == [0, 1]
    assert {g["world"] for g in gathered} == {2} and {g["backend"] for g in gathered} == {"gloo"}
    assert len({g["pid"] for g in gathered} | {os.getpid()}) == 3  # two fresh processes
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
    assert _no_children_left()


def test_worker_exception_becomes_workererror_with_traceback():
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        processes.launch(fail_on_rank_one, 2, timeout_s=120)
    message = str(caught.value)
    assert "worker 1 failed" in message and "ValueError: rank one is broken" in message
    assert "\n" not in message and "Traceback" in caught.value.details  # one line; the traceback in details
    assert time.monotonic() - started < 60, "rank 0 was left waiting in its barrier"
    assert _no_children_left()


def test_worker_that_dies_without_a_word_is_reported():
    with pytest.raises(WorkerError, match="worker 1 died with exit code 3"):
        processes.launch(exit_hard_on_rank_one, 2, timeout_s=120)
    assert _no_children_left()


def test_unpicklable_result_is_an_error_not_a_hang():
    with pytest.raises(WorkerError, match="cannot be sent back"):
        processes.launch(return_unpicklable, 1)
    assert _no_children_left()


def test_workers_may_start_dataloader_workers():
    assert processes.launch(load_with_workers, 1) == [0, 1, 2, 3]


def test_launch_from_a_notebook_cell(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "from maskrcnn_tut.lab import proofs\n"
        "from maskrcnn_tut.lab.processes import launch\n"
        "result = launch(proofs.ddp_accumulation_check, 2)\n"
        "print('world', result['world_size'], 'diff', result['max_abs_diff'])",
        "import multiprocessing\nprint('children left:', len(multiprocessing.active_children()))",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = ["".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream") for cell in notebook.cells]
    assert "world 2" in text[0]
    assert float(text[0].split("diff")[1].split()[0]) < 1e-5  # DDP + accumulation equals one big batch
    assert "children left: 0" in text[1]
