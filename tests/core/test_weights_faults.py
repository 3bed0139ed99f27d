"""`--weights`, `--weights-backbone` and predict's `--checkpoint` given files that are not what they should
be (issue 36's fault probes): each ends in one `error: ...` line saying what the file is, exit code 2, never
a traceback, a warning from torch, torch's advice to load the file unsafely, or a run on random weights.

Already right before issue 36: another architecture's state dict and an empty dict. Fixed there: a text
file and an empty file (torch's `IndexError: pop from empty list`, `EOFError: `), a pickle that would run
code (torch's advice to load it with `weights_only=False` repeated; a plain pickle's protocol warning
printed), a truncated file (torch's message cut mid-sentence), tensors of another shape outside the
backbone (the FPN and heads silently re-initialised), tensors that are not floating point or not finite.
Every file is built here; nothing downloads."""
import os
import pickle

import pytest
import torch
import torchvision

from maskrcnn_tut import predict
from maskrcnn_tut.config import make_config
from maskrcnn_tut.model import build_model
from maskrcnn_tut.train import main

CLASSES = 4  # the shapes' 3 + background
MARK = "/tmp/maskrcnn_tut-weights-fault-ran-code"


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))


@pytest.fixture(scope="module")
def good() -> dict:
    """A cpu-tiny Mask R-CNN state dict, the model train.py builds for the shapes."""
    torch.manual_seed(0)
    return build_model(make_config("cpu-tiny"), CLASSES).state_dict()


def _floats(state: dict, change) -> dict:
    return {k: change(k, v) if v.is_floating_point() else v for k, v in state.items()}


def _truncated(path, state):
    torch.save(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


#: name: (writes the file from a good state dict, what the error line says)
FAULTS = {
    "text": (lambda path, state: path.write_text("these are not weights\n"), "a text file, not one torch.save wrote"),
    "empty-file": (lambda path, state: path.write_bytes(b""), "the file is empty"),
    "pickle-running-code": (lambda path, state: torch.save({"model": RunsCode()}, path),
                            "refused, it holds Python objects, not only tensors, and loading them could run code "
                            "(it names posix.system)"),
    "plain-pickle-running-code": (lambda path, state: path.write_bytes(pickle.dumps(RunsCode(), protocol=4)),
                                  "could run code"),
    "truncated": (_truncated, "cut short or damaged"),
    "empty-dict": (lambda path, state: torch.save({}, path), "holds no state dict"),
    "another-architecture": (lambda path, state: torch.save(torchvision.models.mobilenet_v3_small().state_dict(), path),
                             "does not match this model"),
    "int8": (lambda path, state: torch.save(_floats(state, lambda k, v: v.to(torch.int8)), path),
             "torch.int8 vs the model's torch.float32"),
    "nan": (lambda path, state: torch.save(_floats(state, lambda k, v: torch.full_like(v, float("nan"))), path),
            "holds NaN or infinite values"),
}


def _one_error_line(capsys, recwarn) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out and "weights_only" not in lines[0]
    assert not [w for w in recwarn if "pickle" in str(w.message)], [str(w.message) for w in recwarn]
    assert not os.path.exists(MARK)  # the pickle's code never ran
    return lines[0]


@pytest.mark.parametrize("flag", ["--weights", "--weights-backbone"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_weights_file_is_one_line_and_exit_2(good, small_shapes, tmp_path, capsys, recwarn, flag, fault):
    write, says = FAULTS[fault]
    path = tmp_path / "weights.pt"
    write(path, good if flag == "--weights" else {k.removeprefix("backbone.body."): v for k, v in good.items()
                                                  if k.startswith("backbone.body.")})
    mode = ["--test-only"] if flag == "--weights" else ["--max-steps", "1"]  # the model is built before either
    flags = ["--data-path", str(small_shapes), "--output-dir", str(tmp_path / "run"), "--no-progress",
             "--min-size", "96", "--max-size", "128", "--workers", "0", flag, str(path), *mode]
    assert main(flags) == 2
    line = _one_error_line(capsys, recwarn)
    assert line.startswith(f"error: {flag} {path}: ") and says in line, line


def test_tensors_of_another_shape_outside_the_backbone_are_refused_not_reinitialised(good, tmp_path):
    """The FPN of another width: before, its tensors were left at random and the run went on."""
    wider = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) if k.startswith("backbone.fpn.") and v.ndim else v
             for k, v in good.items()}
    torch.save(wider, tmp_path / "wider.pt")
    with pytest.raises(Exception, match=r"does not match this model \(backbone\.fpn\.inner_blocks\.0\.0\.weight: "
                                        r"shape \(65, 64, 1, 1\) vs the model's \(64, 64, 1, 1\)\)") as caught:
        build_model(make_config("cpu-tiny", weights=str(tmp_path / "wider.pt")), CLASSES)
    assert "--preset gpu-r50" in str(caught.value) and "\n" not in str(caught.value)


def test_the_class_layers_alone_may_differ(good, tmp_path):
    """A file of another class count (a fine-tune's start) still loads; only its class layers start afresh."""
    torch.save(good, tmp_path / "four.pt")
    model = build_model(make_config("cpu-tiny", weights=str(tmp_path / "four.pt")), CLASSES + 2)
    own = model.state_dict()
    assert torch.equal(own["backbone.fpn.layer_blocks.0.0.weight"], good["backbone.fpn.layer_blocks.0.0.weight"])
    assert own["roi_heads.box_predictor.cls_score.weight"].shape[0] == CLASSES + 2


@pytest.mark.parametrize("fault", ["text", "empty-file", "plain-pickle-running-code", "truncated"])
def test_predict_says_a_bad_checkpoint_file_in_one_line(good, small_shapes, tmp_path, capsys, recwarn, fault):
    write, says = FAULTS[fault]
    path = tmp_path / "last.pt"
    write(path, good)
    image = sorted((small_shapes / "val2017").iterdir())[0]
    assert predict.main(["--checkpoint", str(path), "--out", str(tmp_path / "out"), "--workers", "0",
                         "--no-progress", str(image)]) == 2
    line = _one_error_line(capsys, recwarn)
    assert line.startswith(f"error: {path}: cannot be loaded (") and says in line, line
