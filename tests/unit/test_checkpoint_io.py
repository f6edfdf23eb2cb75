"""llmpipe.checkpoint.io without processes: what each rank claims is hashed and listed, unclaimed
files are hashed by rank 0, a failed write is one line and leaves earlier checkpoints usable,
retention deletes only after the newest verified, and a full disk (a small tmpfs, as root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llmpipe.checkpoint import io as ckpt
from llmpipe.manifest import sha256_file


def _writer(files: dict[str, int], claim: bool = True):
    def write(folder: Path):
        for name, size in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(os.urandom(size))
        return [folder / n for n in files] if claim else None
    return write


def test_claimed_and_unclaimed_files_are_all_listed_with_digests_and_sizes(tmp_path):
    def write(folder):
        _writer({"a.bin": 10, "sub/b.bin": 20})(folder)
        return [folder / "a.bin"]  # sub/b.bin unclaimed: rank 0 hashes it
    folder = ckpt.save(tmp_path, 2, write, {"format": "test"})
    meta = ckpt.read_meta(folder)
    assert meta["files"] == {"a.bin": sha256_file(folder / "a.bin"), "sub/b.bin": sha256_file(folder / "sub/b.bin")}
    assert meta["bytes"] == {"a.bin": 10, "sub/b.bin": 20}
    assert ckpt.verify(folder) is None and not (tmp_path / "step-000002.tmp").exists()


def test_a_failed_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    ckpt.save(tmp_path, 1, _writer({"a.bin": 10}), {})

    def fail(folder):
        raise OSError(28, "No space left on device", str(folder / "a.bin"))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save(tmp_path, 2, fail, {})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("checkpoint step-000002 not saved: rank 0: ")
    assert "No space left on device" in msg and msg.endswith("previous checkpoint step-000001 kept")
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]  # the partial folder is gone
    assert ckpt.latest_valid(tmp_path) == tmp_path / "step-000001"


def test_prune_refuses_while_the_newest_checkpoint_does_not_verify(tmp_path):
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, _writer({"a.bin": 10}), {})
    (ckpt.step_dir(tmp_path, 3) / "a.bin").write_bytes(b"torn")
    assert ckpt.prune(tmp_path, 1) == []
    assert len(ckpt.list_steps(tmp_path)) == 3
    # `verified` only spares the re-hash of the folder it names: the corrupted newest is still checked
    assert ckpt.prune(tmp_path, 1, verified=ckpt.step_dir(tmp_path, 2)) == []
    (ckpt.step_dir(tmp_path, 3) / "a.bin").unlink()
    ckpt.save(tmp_path, 3, _writer({"a.bin": 10}), {})  # rewritten: verifies again
    assert [p.name for p in ckpt.prune(tmp_path, 1)] == ["step-000001", "step-000002"]


def test_retention_keeps_the_last_stable_phase_checkpoint_it_is_told_to_protect(tmp_path):
    saver = ckpt.Saver(tmp_path, keep_last=1, protect=4)  # wsd: decay starts after step 4
    for step in (2, 4, 6, 8):
        saver.save(step, _writer({"a.bin": 10}), {})
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step-000004", "step-000008"]


def test_saver_prunes_after_the_new_checkpoint_verified(tmp_path):
    saver = ckpt.Saver(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        assert saver.save(step, _writer({"a.bin": 10}), {}) >= 0
    assert [p.name for p in ckpt.list_steps(tmp_path)] == ["step-000002", "step-000003"]


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount -t tmpfs failed (no CAP_SYS_ADMIN in this container)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_fails_the_save_with_one_line_and_the_previous_checkpoint_verifies(small_disk):
    root = small_disk / "checkpoints"
    ckpt.save(root, 1, _writer({"model.bin": 100_000}), {})
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.save(root, 2, _writer({"model.bin": 100_000, "optim.bin": 200_000}), {})
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and "step-000001 kept" in msg
    assert ckpt.verify(ckpt.step_dir(root, 1)) is None
    assert ckpt.latest_valid(root) == ckpt.step_dir(root, 1)
    assert not ckpt.step_dir(root, 2).exists() and not (root / "step-000002.tmp").exists()
