"""Image files at start-up: where a `file_name` may point, and what a file's header says.

`probe_image` opens each file once and reads its header (and, for a PNG, its chunk list), so a
start-up scan of COCO's 118k files stays cheap; problems are counted in a `DataReport`
(`maskrcnn_tut.data.clean`).
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from PIL import Image

#: The bytes a complete file of the format ends with: a cheap check for truncation at start-up.
_TRAILERS = {"PNG": b"IEND\xaeB`\x82", "JPEG": b"\xff\xd9"}


def _ends_cleanly(f, image_format: str | None) -> bool:
    """Whether the open file `f` ends as a complete file of its format (True when no cheap check)."""
    trailer = _TRAILERS.get(image_format)
    if trailer is None:
        return True  # no cheap check for this format (`verify_pixels` decodes it)
    position = f.tell()
    f.seek(0, 2)
    f.seek(max(0, f.tell() - 64))
    complete = trailer in f.read()
    f.seek(position)
    return complete


def _may_have_exif(f, image_format: str | None) -> bool:
    """False for a PNG with no eXIf chunk (read from the chunk headers, without decoding)."""
    if image_format != "PNG":
        return True
    position = f.tell()
    try:
        f.seek(8)
        while True:
            header = f.read(8)
            if len(header) < 8 or header[4:] == b"IEND":
                return False
            if header[4:] == b"eXIf":
                return True
            f.seek(int.from_bytes(header[:4], "big") + 4, 1)
    finally:
        f.seek(position)


def confined_path(image_dir: Path, file_name: str) -> Path | None:
    """`image_dir / file_name`, or None when the name could point outside the folder (absolute, a
    `..` part) or is no file name at all. Symbolic links inside the folder are the user's layout."""
    if not file_name or "\x00" in file_name:
        return None
    pure = PurePosixPath(file_name)
    if pure.is_absolute() or ".." in pure.parts or Path(file_name).is_absolute():
        return None
    return image_dir / file_name


def probe_image(path: Path, report, image_id, verify_pixels: bool) -> tuple[int, int] | None:
    """The upright size of a usable image file, else None (counted).

    Reads the header, and decodes the pixels only when the file does not end like a complete PNG
    or JPEG (or when `verify_pixels`), so a start-up scan of COCO stays cheap (one open per file).
    The open does not wait (`O_NONBLOCK`): a pipe, socket or device is counted as `not_a_file`
    without a read, where a plain open of a pipe would wait forever for a writer.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            report.add("bad_file_name", image_id)
        elif err.errno in (errno.ENOENT, errno.ENOTDIR):
            report.add("missing_image", image_id)
        else:  # no permission, an I/O error: there, but not an image file to read
            report.add("unreadable_image", image_id)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, pipe, socket or device
        os.close(fd)
        report.add("not_a_file", image_id)
        return None
    f = os.fdopen(fd, "rb")
    with f:
        try:
            img = Image.open(f)
        except Image.DecompressionBombError:
            report.add("too_many_pixels", image_id)
            return None
        except Exception:  # Pillow raises many types for files it cannot identify
            report.add("unreadable_image", image_id)
            return None
        with img:
            try:
                if verify_pixels or not _ends_cleanly(f, img.format):
                    img.load()
            except Exception:  # truncated or corrupt pixel data, whatever the decoder raises
                report.add("truncated_image", image_id)
                return None
            width, height = img.size
            if img.mode != "RGB":
                report.add("converted_mode", image_id)
            try:  # Pillow decodes a whole PNG to look for EXIF: only when the file has a block
                orientation = img.getexif().get(0x0112, 1) if _may_have_exif(f, img.format) else 1
            except Exception:  # a broken EXIF block is ignored, as exif_transpose ignores it
                orientation = 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    if orientation not in (None, 1):
        report.add("exif_rotated", image_id)
    return width, height
