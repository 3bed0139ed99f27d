"""One atomic write for every file the package keeps (checkpoints, predictions, caches, overlays): a
failed write leaves the previous file as it was and no temporary file beside it."""
import pytest

from maskrcnn_tut.atomic import atomic_write


@pytest.mark.parametrize("durable", [True, False])
def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, durable):
    path = tmp_path / "detections.json"
    atomic_write(path, lambda f: f.write("[1]"), mode="w", durable=durable)

    def disk_full(f):
        f.write("[2, ")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, disk_full, mode="w", durable=durable)
    assert path.read_text() == "[1]"
    assert [p.name for p in tmp_path.iterdir()] == ["detections.json"]
    atomic_write(path, lambda f: f.write(b"[3]"), durable=durable)
    assert path.read_text() == "[3]"
