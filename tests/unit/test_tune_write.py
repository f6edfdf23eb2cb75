"""`llmpipe tune buckets --write` (tune_write.write_bucket_cap) with links and earlier backups: a symlinked
config has its target edited and stays a link; the backup is a new file, never one written through a
planted link, never one that overwrites an earlier backup (CONFIG.bak, then CONFIG.bak.1, ...)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmpipe import config as config_mod
from llmpipe.tools import tune, tune_write

CONFIG = """\
# tiny
run: {name: t, device: cpu}
data: {inputs: [unused], seq_len: 32}
model: {flavor: debug}
train:
  nproc_per_node: 2
  parallel:
    data: ddp
    bucket_cap_mb: 25    # DDP's default
"""
EDITED = CONFIG.replace("bucket_cap_mb: 25 ", "bucket_cap_mb: 10 ")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "conf" / "c.yaml"
    path.parent.mkdir()
    path.write_text(CONFIG)
    return path


def test_a_symlinked_config_has_its_target_edited_and_stays_a_link(config, tmp_path):
    link = tmp_path / "links" / "current.yaml"
    link.parent.mkdir()
    link.symlink_to(os.path.relpath(config, link.parent))
    line = tune_write.write_bucket_cap(link, 10.0)
    assert line == (f"wrote train.parallel.bucket_cap_mb: 10 to {config} (the target of {link}) "
                    f"(the original is {config}.bak)")
    assert link.is_symlink() and link.resolve() == config
    assert config.read_text() == EDITED and config_mod.load(link).train.parallel.bucket_cap_mb == 10
    assert Path(f"{config}.bak").read_text() == CONFIG
    assert sorted(os.listdir(link.parent)) == ["current.yaml"]  # nothing written beside the link


def test_a_symlink_planted_at_the_backup_path_is_not_written_through(config, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    planted = Path(f"{config}.bak")
    planted.symlink_to(victim)
    line = tune_write.write_bucket_cap(config, 10.0)
    assert line == f"wrote train.parallel.bucket_cap_mb: 10 to {config} (the original is {config}.bak.1)"
    assert victim.read_text() == "precious\n" and planted.is_symlink()
    assert Path(f"{config}.bak.1").read_text() == CONFIG and not Path(f"{config}.bak.1").is_symlink()
    assert config.read_text() == EDITED


def test_a_dangling_symlink_at_the_backup_path_creates_nothing_at_its_target(config, tmp_path):
    planted = Path(f"{config}.bak")
    planted.symlink_to(tmp_path / "made-by-tune")
    tune_write.write_bucket_cap(config, 10.0)
    assert not (tmp_path / "made-by-tune").exists() and planted.is_symlink()
    assert Path(f"{config}.bak.1").read_text() == CONFIG


def test_an_earlier_backup_is_kept_and_the_new_one_numbered(config):
    earlier = Path(f"{config}.bak")
    earlier.write_text("the first original\n")
    assert tune_write.write_bucket_cap(config, 10.0).endswith(f"(the original is {config}.bak.1)")
    assert tune_write.write_bucket_cap(config, 5.0).endswith(f"(the original is {config}.bak.2)")
    assert earlier.read_text() == "the first original\n"
    assert Path(f"{config}.bak.1").read_text() == CONFIG and Path(f"{config}.bak.2").read_text() == EDITED
    assert config_mod.load(config).train.parallel.bucket_cap_mb == 5


def test_when_every_backup_name_is_taken_nothing_is_written(config):
    for i in range(tune_write.MAX_BACKUPS):
        Path(f"{config}.bak" + (f".{i}" if i else "")).write_text("old\n")
    with pytest.raises(tune.TuneError, match=rf"^{config}: c.yaml.bak and 99 numbered backups of it exist; "
                       r"remove the ones you do not need; not written$"):
        tune_write.write_bucket_cap(config, 10.0)
    assert config.read_text() == CONFIG and sorted(os.listdir(config.parent))[:2] == ["c.yaml", "c.yaml.bak"]
    assert len(os.listdir(config.parent)) == 1 + tune_write.MAX_BACKUPS  # no temporary file left
