"""Issue 23 item 5, in the ranks: a rank prints one `error:` line only for a llmpipe.errors.UserError;
anything else, a ValueError raised inside torch included, is a bug and stays a traceback. Either way
the rank writes its structured error file (llmpipe.train.main) with the traceback beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import make_cfg

# The rank's entry point as torchrun runs it, its training replaced by a call torch rejects.
TORCH_VALUE_ERROR = (
    "import sys, torch\n"
    "from llmpipe.train import loop, main\n"
    "loop.train = lambda *a: torch.nn.functional.cross_entropy(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long),"
    " reduction='bogus')\n"
    "main.main(sys.argv[1:])\n"
)


def _rank(tmp_path: Path, data_dir: Path, argv: list[str], **sections) -> tuple[int, str, dict]:
    """Run one rank (no process group); (exit code, stderr, its error file's extraInfo)."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(make_cfg(tmp_path, **sections).to_dict()))
    error_file = tmp_path / "rank0" / "error.json"
    error_file.parent.mkdir()
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "OMP_NUM_THREADS": "1"}
    args = ["--config", str(config), "--data", str(data_dir), "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, *argv, *args], env=env, capture_output=True, text=True, timeout=300)
    info = json.loads(error_file.read_text())["message"]["extraInfo"]
    return proc.returncode, proc.stderr, info


def test_a_value_error_raised_by_torch_in_a_rank_is_reported_as_a_traceback(tmp_path, data_dir):
    code, stderr, info = _rank(tmp_path, data_dir, ["-c", TORCH_VALUE_ERROR])
    assert code == 1
    assert "Traceback (most recent call last)" in stderr and "torch/nn/functional.py" in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "ValueError: bogus is not a valid value for reduction", stderr[-3000:]
    assert not [ln for ln in stderr.splitlines() if "error: " in ln and ln.startswith("[rank")], stderr[-3000:]
    assert info["type"] == "ValueError" and info["user_error"] is False
    assert "torch/nn/functional.py" in (tmp_path / "rank0" / "traceback.txt").read_text()


def test_a_user_error_in_a_rank_is_reported_as_one_line(tmp_path, data_dir):
    # the shards were packed for seq_len 32 (tests.conftest.make_data_dir)
    code, stderr, info = _rank(tmp_path, data_dir, ["-m", "llmpipe.train.main"], data={"seq_len": 16})
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines() == ["[rank0] error: data.seq_len=16 but the shards were packed for 32"]
    assert info["type"] == "TrainError" and info["user_error"] is True
    assert info["error"] == "data.seq_len=16 but the shards were packed for 32"
