"""The torchrun command builder (pure) and the process-group runner."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from llmpipe.train.launch import run_streaming, torchrun_argv, torchrun_env


def test_torchrun_argv_single_node_meets_in_a_file_and_on_loopback_only():
    argv = torchrun_argv(2, Path("c.yaml"), Path("data"), Path("out"), python="py", rdzv_id="x")
    assert argv == ["py", "-m", "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=out/torchrun-logs/rendezvous.filestore",
                    "--rdzv-conf=store_type=file,keep_alive_interval=3600", "--rdzv-id=x", "--local-addr=127.0.0.1",
                    "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=1", "--log-dir=out/torchrun-logs",
                    "-m", "llmpipe.train.main", "--config", "c.yaml", "--data", "data", "--out", "out"]
    assert "--standalone" not in argv  # its rendezvous TCPStore listens on every interface
    assert torchrun_env(1) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # nor does the agent serve one
    # a fresh rendezvous id per launch: the file keeps a finished launch's state, closed, under its id
    ids = {a for _ in range(2) for a in torchrun_argv(1, Path("c"), Path("d"), Path("o")) if a.startswith("--rdzv-id")}
    assert len(ids) == 2


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


def test_torchrun_argv_multi_node_meets_at_a_c10d_rendezvous():
    argv = torchrun_argv(8, Path("c"), Path("d"), Path("o"), python="py", nnodes=4, node_rank=2,
                         rdzv_endpoint="10.0.0.1:29400", rdzv_id="llama7b", max_restarts=3)
    assert "--standalone" not in argv
    assert argv[3:8] == ["--nnodes=4", "--node-rank=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
                         "--rdzv-id=llama7b"]
    assert "--max-restarts=3" in argv and "--local-addr=127.0.0.1" not in argv
    assert torchrun_env(4) == {}  # node 0's store must be reachable from the others
    with pytest.raises(ValueError, match="2 nodes need a rendezvous endpoint"):
        torchrun_argv(8, Path("c"), Path("d"), Path("o"), nnodes=2)


def test_train_section_chooses_the_torchrun_launch_and_refuses_what_cannot_work(tmp_path):
    from llmpipe.stages import StageError
    from llmpipe.train.launch import launch_world
    from llmpipe.train.stage import _launch_argv
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, train__nproc_per_node=2, train__nodes=3, train__node_rank=1, train__restarts=2,
                   train__rdzv_endpoint="head:29400", run__name="big")
    argv = _launch_argv(cfg, Path("c.yaml"), Path("d"), Path("o"))
    assert argv[3:8] == ["--nnodes=3", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400",
                         "--rdzv-id=big"] and "--max-restarts=2" in argv
    assert launch_world(cfg) == (6, 3)
    for bad, match in (({"rdzv_endpoint": None}, "train.nodes=3 needs train.rdzv_endpoint"),
                       ({"node_rank": 3}, "train.node_rank=3 but train.nodes=3")):
        with pytest.raises(StageError, match=match):
            _launch_argv(cfg.model_copy(update={"train": cfg.train.model_copy(update=bad)}), Path("c"), Path("d"),
                         Path("o"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb slots=2\n")
    both = cfg.model_copy(update={"train": cfg.train.model_copy(update={"hostfile": str(hostfile)})})
    with pytest.raises(StageError, match="^train.nodes=3 with train.hostfile: .* set one or the other$"):
        _launch_argv(both, Path("c"), Path("d"), Path("o"))


def _rank_folder(attempt: Path, local: int, rank: int, *, raised: tuple[str, float, bool] | None = None,
                 sigterm: bool = False, exited: bool = False) -> None:
    """A rank's files in a torchrun attempt folder, as llmpipe.train.main writes them."""
    folder = attempt / str(local)
    folder.mkdir(parents=True)
    (folder / "rank.json").write_text(json.dumps({"rank": rank, **({"exit": 1} if exited or raised else {})}))
    (folder / "sigterm.txt").write_text("Current thread 0x1 (most recent call first):\n" if sigterm else "")
    if raised:
        kind, when, user = raised
        info = {"py_callstack": "Traceback ...", "timestamp": str(int(when)), "time": when, "rank": rank,
                "type": kind, "error": f"boom {rank}", "user_error": user}
        (folder / "error.json").write_text(json.dumps({"message": {"message": f"{kind}: boom", "extraInfo": info}}))
        (folder / "traceback.txt").write_text("Traceback ...")


@pytest.mark.parametrize("case", ["raised", "user", "killed", "terminated", "lost-node"])
def test_a_failed_launch_is_one_line_from_the_ranks_files(tmp_path, case):
    from llmpipe.train.stage import failure

    logs = tmp_path / "torchrun-logs"
    old = logs / "run_old" / "attempt_0"  # a previous launch's files are not this one's
    _rank_folder(old, 0, 0, raised=("ValueError", 1.0, True))
    os.utime(old, (1.0, 1.0))
    attempt = logs / "run_x" / "attempt_0"
    since = time.time()
    agent = logs / "agent-error-node0.json"
    if case == "raised":  # rank 1 raised first; rank 0 followed (a lost peer), later
        _rank_folder(attempt, 0, 0, raised=("RuntimeError", since + 0.5, False), sigterm=True)
        _rank_folder(attempt, 1, 1, raised=("RuntimeError", since + 0.2, False))
    elif case == "user":
        _rank_folder(attempt, 0, 0, raised=("ConfigError", since, True))
        _rank_folder(attempt, 1, 1, sigterm=True)
    elif case == "killed":  # rank 1 vanished (SIGKILL); rank 0 raised after it
        _rank_folder(attempt, 0, 0, raised=("RuntimeError", since, False))
        _rank_folder(attempt, 1, 1)
    elif case == "terminated":
        _rank_folder(attempt, 0, 0, sigterm=True)
        _rank_folder(attempt, 1, 1, sigterm=True)
    else:  # this node's rank raised when the other node went away; torchrun lost its rendezvous
        _rank_folder(attempt, 0, 0, raised=("RuntimeError", since, False))
        agent.write_text(json.dumps({"message": {"message": "RendezvousConnectionError: store gone",
                                                 "extraInfo": {"timestamp": "0"}}}))
    err = failure(1, logs, agent, since)
    line = str(err)
    assert "\n" not in line and line.startswith("training failed: torchrun exited with 1: ")
    tb = attempt / "1" / "traceback.txt"
    expected = {
        "raised": (f"rank 1 raised RuntimeError: boom 1 (traceback: {tb})", False),
        "user": (f"rank 0: boom 0 (traceback: {attempt / '0' / 'traceback.txt'})", False),
        "killed": ("rank 1 died from a signal without an error file", True),
        "terminated": ("rank 0 was stopped by SIGTERM", True),
        "lost-node": ("rank 0 raised RuntimeError: boom 0 (traceback: ", True),
    }[case]
    assert expected[0] in line and err.transient == expected[1], line
    if case == "lost-node":
        assert line.endswith("; torchrun: RendezvousConnectionError: store gone")


def test_run_streaming_streams_lines_and_returns_the_exit_code():
    lines: list[str] = []
    code, tail = run_streaming([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(3)"], lines.append)
    assert code == 3 and lines == ["a", "b"] and tail == ["a", "b"]


def test_run_streaming_appends_stderr_to_a_file_when_told_and_streams_stdout_alone(tmp_path):
    script = "import sys; print('out'); print('noise', file=sys.stderr); raise SystemExit(1)"
    log = tmp_path / "logs" / "stderr.log"
    for _ in range(2):  # a second launch appends
        lines: list[str] = []
        code, _ = run_streaming([sys.executable, "-c", script], lines.append, stderr_to=log)
        assert code == 1 and lines == ["out"]
    text = log.read_text().splitlines()
    assert text[1::2] == ["noise", "noise"] and all(ln.startswith("=== ") for ln in text[::2])  # launch headers


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
