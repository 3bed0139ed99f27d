"""The figure cache within a build (lab/stored/within_build.py): within a session a call runs once and its repeat writes the same
lines and returns the same result; outside a session every call runs."""
from __future__ import annotations

import os
import sys
import time

import pytest

from maskrcnn_tut.lab.stored import within_build

CALLS: list[tuple] = []


def measured(size: int, label: str = "fp32") -> dict:
    """A stand-in figure: counts its calls, writes to both streams, returns fresh data."""
    CALLS.append((size, label))
    print(f"measuring {label} at {size} px")
    print(f"a log line for {size}", file=sys.stderr)
    return {"size": size, "label": label, "value": time.perf_counter()}


@pytest.fixture
def session(tmp_path, monkeypatch):
    CALLS.clear()
    monkeypatch.setenv(within_build.SESSION_ENV, str(tmp_path))
    return tmp_path


def test_outside_a_session_every_call_runs(monkeypatch):
    CALLS.clear()
    monkeypatch.delenv(within_build.SESSION_ENV, raising=False)
    first, second = within_build.once(measured, 64), within_build.once(measured, 64)
    assert len(CALLS) == 2 and first["value"] != second["value"]


def test_in_a_session_the_repeat_writes_the_same_lines_and_returns_the_kept_result(session, capsys):
    first = within_build.once(measured, 64, label="bf16")
    written = capsys.readouterr()
    again = within_build.once(measured, 64, "bf16")  # the same call, the default filled in or not
    replayed = capsys.readouterr()
    assert CALLS == [(64, "bf16")]
    assert again == first
    assert (replayed.out, replayed.err) == (written.out, written.err) == ("measuring bf16 at 64 px\n", "a log line for 64\n")


class Diverged(FloatingPointError):
    pass


class Unrebuildable(RuntimeError):
    def __init__(self, step: int, loss: float):
        super().__init__(f"step {step}: loss {loss}")


def failing(size: int) -> None:
    CALLS.append((size, "fails"))
    print(f"step 1 at {size} px")
    raise Diverged(f"non-finite loss at {size} px")


def failing_oddly(size: int) -> None:
    CALLS.append((size, "fails oddly"))
    raise Unrebuildable(size, float("nan"))


def test_a_repeat_raises_the_kept_error_after_the_same_lines(session, capsys):
    for _ in range(2):
        with pytest.raises(Diverged, match="non-finite loss at 64 px"):
            within_build.once(failing, 64)
        assert capsys.readouterr().out == "step 1 at 64 px\n"
    assert CALLS == [(64, "fails")]


def test_an_error_that_does_not_pickle_back_runs_again(session):
    for _ in range(2):
        with pytest.raises(Unrebuildable):
            within_build.once(failing_oddly, 64)
    assert CALLS == [(64, "fails oddly")] * 2


def test_other_arguments_measure_again(session):
    within_build.once(measured, 64)
    within_build.once(measured, 96)
    within_build.once(measured, 64, label="bf16")
    assert CALLS == [(64, "fp32"), (96, "fp32"), (64, "bf16")]


def test_functions_as_arguments_are_keyed_by_their_import_path(session):
    assert within_build.stable_repr(measured) == f"{measured.__module__}.measured"
    assert within_build.stable_repr([measured, 2, {"a": (1, 2)}]) == f"list({measured.__module__}.measured, 2, {{'a': tuple(1, 2)}})"


def test_what_cannot_be_keyed_the_same_in_every_kernel_is_refused(session):
    with pytest.raises(TypeError, match="no stable repr"):
        within_build.once(measured, object())
    with pytest.raises(TypeError, match="importable"):
        within_build.once(lambda: 1)
    assert CALLS == []


def test_work_dir_is_shared_in_a_session_and_fresh_outside(session, monkeypatch):
    assert within_build.work_dir("run") == within_build.work_dir("run") == session / "work" / "run"
    monkeypatch.delenv(within_build.SESSION_ENV)
    one, two = within_build.work_dir("run"), within_build.work_dir("run")
    assert one != two and one.is_dir() and two.is_dir()


def test_a_session_starts_once_and_its_end_removes_it(tmp_path, monkeypatch):
    monkeypatch.delenv(within_build.SESSION_ENV, raising=False)
    monkeypatch.setenv("MASKRCNN_TUT_CACHE", str(tmp_path))
    stale = tmp_path / "figures" / "killed-build"
    stale.mkdir(parents=True)
    os.utime(stale, (time.time() - 2 * within_build.STALE_AFTER_S,) * 2)
    folder = within_build.start_session()
    assert os.environ[within_build.SESSION_ENV] == str(folder) and folder.is_dir() and not stale.exists()
    assert within_build.start_session() == folder  # a build inside a test session joins it
    within_build.end_session(folder)
    assert not folder.exists() and within_build.SESSION_ENV not in os.environ
