"""`python -m maskrcnn_tut.predict` on the inputs and output folders of issue 36's fault probes: each image
is predicted or skipped with a counted, logged reason, and an output folder that cannot be written is one
`error: ...` line (exit 2), never a traceback.

Fixed there: a decompression bomb under twice PIL's pixel limit was decoded whole (an 11 KB PNG of 95
megapixels took over 20 GB before the kernel killed predict); an output folder that is read-only, a file,
under a file, or full ended in a traceback. Already right, kept by `test_inputs_that_already_worked`:
a symlink loop, empty and non-image files named .jpg, EXIF rotation and the image modes."""
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from checkpoints import resumable_payload
from disks import tmpfs
from PIL import Image

from maskrcnn_tut import predict


@pytest.fixture(scope="module")
def checkpoint(small_shapes, tmp_path_factory):
    """A cpu-tiny checkpoint at 96/128 px (untrained: what it finds does not matter here)."""
    path = tmp_path_factory.mktemp("predict-faults") / "last.pt"
    torch.save(resumable_payload(3, data_path=str(small_shapes), min_size=96, max_size=128), path)
    return path


@pytest.fixture(scope="module")
def photo(small_shapes) -> Image.Image:
    return Image.open(sorted((small_shapes / "val2017").iterdir())[0]).convert("RGB")


def _predict(checkpoint, out, *inputs, workers: int = 0):
    return predict.run(predict.build_parser().parse_args(
        ["--checkpoint", str(checkpoint), "--out", str(out), "--workers", str(workers), "--no-progress",
         "--score-threshold", "0", *map(str, inputs)]))


def _png16(path, array: np.ndarray) -> None:
    """A 16-bit RGB (3 channels) or RGBA (4) PNG, which PIL cannot write."""
    height, width, channels = array.shape
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in array)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 16, {3: 2, 4: 6}[channels], 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                     + chunk(b"IEND", b""))


def _exif_rotated(folder, photo):
    image = Image.new("RGB", (200, 100), "white")
    exif = image.getexif()
    exif[0x0112] = 6  # stored 200x100, shown rotated: 100 wide, 200 tall
    image.save(folder / "exif.jpg", exif=exif)


def _symlink_loop(folder, photo):
    (folder / "sub").mkdir()
    photo.save(folder / "sub" / "a.jpg")
    os.symlink("..", folder / "sub" / "loop")


def _deep(array_of):
    return lambda folder, photo: _png16(folder / "deep.png", array_of(np.asarray(photo).astype(np.uint16) * 257))


#: kind: (writes its input into a folder from a photo, the image predicted or the reason it is skipped)
INPUTS = {
    "symlink-loop": (_symlink_loop, "sub/a.jpg"),
    "empty-jpg": (lambda folder, photo: (folder / "empty.jpg").write_bytes(b""), "unreadable"),
    "text-named-jpg": (lambda folder, photo: (folder / "notes.jpg").write_text("not an image"), "unreadable"),
    "exif-rotated": (_exif_rotated, "exif.jpg"),
    "grayscale": (lambda folder, photo: photo.convert("L").save(folder / "gray.png"), "gray.png"),
    "16-bit-gray": (lambda folder, photo: Image.fromarray(np.asarray(photo.convert("L"), dtype=np.uint16) * 257)
                    .save(folder / "deep.png"), "deep.png"),
    "16-bit-rgb": (_deep(lambda rgb: rgb), "deep.png"),
    "16-bit-rgba": (_deep(lambda rgb: np.concatenate([rgb, rgb[..., :1]], axis=2)), "deep.png"),
    "alpha": (lambda folder, photo: photo.convert("RGBA").save(folder / "alpha.png"), "alpha.png"),
    "grey-alpha": (lambda folder, photo: photo.convert("LA").save(folder / "la.png"), "la.png"),
    "palette-transparency": (lambda folder, photo: photo.convert("P").save(folder / "p.png", transparency=0), "p.png"),
    "bilevel": (lambda folder, photo: photo.convert("1").save(folder / "one.png"), "one.png"),
    "cmyk": (lambda folder, photo: photo.convert("CMYK").save(folder / "cmyk.jpg"), "cmyk.jpg"),
}


@pytest.mark.parametrize("kind", INPUTS)
def test_inputs_that_already_worked(checkpoint, photo, tmp_path, caplog, kind):
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    write, expected = INPUTS[kind]
    write(folder, photo)
    summary = _predict(checkpoint, out, folder)
    if expected == "unreadable":
        assert summary["images"] == 0 and summary["skipped"] == {"unreadable": 1}
        assert "skipped" in caplog.text and "unreadable" in caplog.text
        return
    assert summary["images"] == 1 and summary["skipped"] == {}
    overlay = Image.open(out / "overlays" / os.path.basename(expected))
    assert overlay.mode == "RGB"
    if kind == "exif-rotated":
        assert overlay.size == (100, 200)  # upright, as a viewer shows it
    else:
        assert overlay.size == photo.size


def test_a_decompression_bomb_is_skipped_before_it_is_decoded(checkpoint, photo, tmp_path, monkeypatch, caplog,
                                                              recwarn):
    """PIL warns between its limit and twice it and refuses above; both are skipped as too_large, unread.
    The limit is lowered here so that the bombs are small; with workers, as the command runs."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    folder = tmp_path / "in"
    folder.mkdir()
    Image.new("1", (120, 100)).save(folder / "warned.png")  # 12,000 pixels: PIL only warns
    Image.new("1", (250, 100)).save(folder / "refused.png")  # 25,000: over twice the limit
    photo.resize((100, 75)).save(folder / "fine.jpg")  # 7,500 pixels
    monkeypatch.setattr(predict, "read_rgb", _never_decodes(predict.read_rgb))
    summary = _predict(checkpoint, tmp_path / "out", folder, workers=2)
    assert summary["images"] == 1 and summary["skipped"] == {"too_large": 2}, summary
    assert caplog.text.count("too_large (Image size (") == 2, caplog.text
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def _never_decodes(read_rgb):
    """read_rgb that fails the test if it gets to decode a bomb's pixels (`Image.open` reads the header)."""
    def guarded(path):
        image = read_rgb(path)
        assert image.width * image.height <= Image.MAX_IMAGE_PIXELS, f"{path} was decoded"
        return image
    return guarded


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in captured.err, captured.err
    assert not [line for line in lines[:-1] if not line[:2].isdigit()], captured.err  # log lines only before it
    return lines[-1]


@pytest.mark.parametrize("where,says", [
    ("read-only", "cannot write there (Read-only file system); give a folder this process can write to"),
    ("read-only/new", "cannot write "),
    ("a-file", "is a file, not a folder"),
    ("a-file/new", "(Not a directory)"),
])
def test_an_output_folder_that_cannot_be_written_is_one_line(checkpoint, small_shapes, tmp_path, capsys, where, says):
    (tmp_path / "a-file").write_text("a file, where --out wants a folder")
    with tmpfs(tmp_path / "read-only", read_only=True):
        out = tmp_path / where
        code = predict.main(["--checkpoint", str(checkpoint), "--out", str(out), "--workers", "0", "--no-progress",
                             str(small_shapes / "val2017")])
    assert code == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: --out {out}: ") and says in line, line
    assert not (tmp_path / "read-only" / "overlays").exists()


def test_a_full_output_folder_is_one_line(checkpoint, small_shapes, tmp_path, capsys):
    """Room for the folder and a byte, not for the first overlay."""
    with tmpfs(tmp_path / "full", size="16k"):
        code = predict.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "full"), "--workers", "0",
                             "--no-progress", str(small_shapes / "val2017")])
        left = sorted(p.name for p in (tmp_path / "full").rglob("*") if p.is_file())
    assert code == 2
    line = _one_error_line(capsys)
    assert "(No space left on device); free space there or give another --out" in line, line
    assert left == []  # no half-written overlay or temporary file


def test_masks_pasted_and_drawn_one_at_a_time_are_torchvision_s():
    from torchvision.models.detection.roi_heads import paste_masks_in_image
    from torchvision.utils import draw_segmentation_masks

    from maskrcnn_tut.evaluate import binary_masks
    from maskrcnn_tut.overlay import paint_masks

    generator = torch.Generator().manual_seed(0)
    small = torch.rand(7, 1, 28, 28, generator=generator)
    corners = torch.rand(7, 2, generator=generator) * torch.tensor([90.0, 60.0]) - 5
    boxes = torch.cat([corners, corners + torch.rand(7, 2, generator=generator) * 40 + 1], dim=1)
    whole = paste_masks_in_image(small, boxes, (70, 100))[:, 0] > 0.5
    one_at_a_time = torch.stack(list(binary_masks({"masks": small, "boxes": boxes, "image_size": (70, 100)})))
    assert torch.equal(one_at_a_time, whole)
    image = torch.randint(0, 256, (3, 70, 100), dtype=torch.uint8, generator=generator)
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (9, 99, 199), (1, 2, 3), (200, 100, 0), (50, 50, 50)]
    assert torch.equal(paint_masks(image, iter(whole), colors),
                       draw_segmentation_masks(image, whole, alpha=0.45, colors=colors))


def test_thousands_of_tiny_images_are_counted_in_a_few_lines(checkpoint, photo, tmp_path, caplog, capsys):
    """Issue 36 probe (already right but for the lines, kept here): 3,000 4x4 PNGs beside two 8x8 ones,
    with workers: each tiny one skipped as too_small and counted, 5 named (the fifth says the rest are only
    counted), one summary line; the 8x8 ones (MIN_SIDE) predicted."""
    folder = tmp_path / "in"
    folder.mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (3002, 8, 8, 3), dtype=np.uint8)
    for k in range(3000):
        Image.fromarray(pixels[k, :4, :4]).save(folder / f"{k:04d}.png")
    for k in (3000, 3001):
        Image.fromarray(pixels[k]).save(folder / f"{k:04d}.png")
    summary = _predict(checkpoint, tmp_path / "out", folder, workers=2)
    assert summary["images"] == 2 and summary["skipped"] == {"too_small": 3000}, summary
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    assert len(named) == predict.LOGGED_SKIPS and named[-1].endswith("later skips are only counted, in the summary")
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("predicted 2 images (") and "skipped too_small 3000;" in line, line


def test_ctrl_c_is_one_line_about_predict_not_checkpoints(checkpoint, small_shapes, tmp_path, monkeypatch, capsys):
    """Issue 36 probe: Ctrl-C in predict said train.py's line, "the checkpoints already written are kept
    (--resume auto continues from the last)", of a command that writes none and has no --resume."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(predict.overlay, "save", interrupt)
    handler = signal.getsignal(signal.SIGINT)
    try:
        code = predict.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--workers", "0",
                             "--no-progress", str(small_shapes / "val2017")])
    finally:
        signal.signal(signal.SIGINT, handler)  # a second Ctrl-C would end the process at once
    assert code == 130
    assert _one_error_line(capsys) == ("error: interrupted (Ctrl-C); the files already in --out are whole; rerun "
                                       "to predict every image")
