"""The torchrun command builder (pure) and the process-group runner."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from llmpipe.train.launch import run_streaming, torchrun_argv


def test_torchrun_argv_single_node():
    argv = torchrun_argv(2, Path("c.yaml"), Path("data"), Path("out"), python="py")
    assert argv == ["py", "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                    "--max-restarts=0", "--monitor-interval=1", "--log-dir=out/torchrun-logs", "-m",
                    "llmpipe.train.main", "--config", "c.yaml", "--data", "data", "--out", "out"]


def test_a_training_run_leaves_no_temporary_folder_behind(tmp_path, data_dir, monkeypatch):
    from tests.conftest import make_cfg, torchrun

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # where torchrun would put its torchelastic_* folder
    cfg = make_cfg(tmp_path, train={"max_steps": 1, "checkpoint": {"every_steps": 1}, "eval": {"every_steps": 1}})
    code, text = torchrun(cfg, data_dir, tmp_path / "out", nproc=1)
    assert code == 0, text[-2000:]
    assert [p.name for p in tmp.iterdir() if p.name.startswith("torchelastic_")] == []
    assert (tmp_path / "out" / "torchrun-logs").is_dir()  # its logs stay with the run instead


def test_torchrun_argv_multi_node():
    argv = torchrun_argv(8, Path("c"), Path("d"), Path("o"), python="py", nnodes=4, node_rank=2,
                         master_addr="10.0.0.1", master_port=29400)
    assert "--standalone" not in argv
    assert argv[3:7] == ["--nnodes=4", "--node-rank=2", "--master-addr=10.0.0.1", "--master-port=29400"]


def test_run_streaming_streams_lines_and_returns_the_exit_code():
    lines: list[str] = []
    code, tail = run_streaming([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(3)"], lines.append)
    assert code == 3 and lines == ["a", "b"] and tail == ["a", "b"]


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
              "[print(i, flush=True) or time.sleep(0.2) for i in range(300)]")
    with pytest.raises(TimeoutError):
        run_streaming([sys.executable, "-c", script], lambda line: None, timeout_s=1.5)
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild is gone too (reaped by init shortly after the kill)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild survived")


def test_deepspeed_launcher_argv_for_several_nodes(tmp_path):
    from llmpipe.config import from_dict
    from llmpipe.stages import StageError
    from llmpipe.train.stage import _launch_argv

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    cfg = from_dict({"data": {"inputs": ["x"]},
                     "train": {"nproc_per_node": 8, "hostfile": str(hostfile), "master_port": 29400}})
    argv = _launch_argv(cfg, Path("c.yaml"), Path("d"), Path("o"))
    assert argv == ["deepspeed", f"--hostfile={hostfile}", "--num_gpus=8", "--master_addr=node-a",
                    "--master_port=29400", "--module", "llmpipe.train.main", "--config", "c.yaml", "--data", "d",
                    "--out", "o"]
    hostfile.write_text("")
    with pytest.raises(StageError, match="train.hostfile: .* lists no hosts"):
        _launch_argv(cfg, Path("c.yaml"), Path("d"), Path("o"))


def test_dist_env_sets_generous_hccl_timeouts():
    from llmpipe import device

    env = device.dist_env("npu", 30)
    assert env["HCCL_CONNECT_TIMEOUT"] == "120" and env["HCCL_EXEC_TIMEOUT"] == "120"
    assert device.dist_env("npu", 3600)["HCCL_EXEC_TIMEOUT"] == "3600"
    assert "HCCL_CONNECT_TIMEOUT" not in device.dist_env("cpu", 3600)


def test_hccl_environment_is_set_from_config_in_one_place(tmp_path):
    from llmpipe import device
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, train__hccl={"algo": "level0:NA;level1:H-D_R", "buffer_size_mb": 400,
                                          "ib_hca": "mlx5_0", "socket_ifname": "eth0"}, train__dist_timeout_s=900)
    env = device.dist_env("npu", cfg.train.dist_timeout_s, cfg.train.hccl)
    assert env["HCCL_ALGO"] == "level0:NA;level1:H-D_R" and env["HCCL_BUFFER_SIZE"] == "400"
    assert env["HCCL_IB_HCA"] == "mlx5_0" and env["HCCL_SOCKET_IFNAME"] == "eth0"
    assert env["HCCL_CONNECT_TIMEOUT"] == env["HCCL_EXEC_TIMEOUT"] == "900"
    unset = device.dist_env("npu", 900, make_cfg(tmp_path).train.hccl)
    assert not any(k in unset for k in ("HCCL_ALGO", "HCCL_BUFFER_SIZE", "HCCL_IB_HCA", "HCCL_SOCKET_IFNAME"))
    assert "HCCL_ALGO" not in device.dist_env("cpu", 900, cfg.train.hccl)
