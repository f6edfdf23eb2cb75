"""A one-node training listens on loopback only: no socket of the train stage's processes (torchrun's
agent, its rendezvous, the ranks' store, gloo) accepts connections from another machine."""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe import stages
from tests.integration.test_faults import _config, _procs_matching, _stage, _wait_for_step

pytestmark = pytest.mark.slow


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.add(pid)
            todo.append(pid)
    return found


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s local address (host byte order per 32-bit word), without the port."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    """(pid, address:port) of every listening TCP socket that one of `pids` holds."""
    listen = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A":  # TCP_LISTEN
                listen[f[9]] = f"{_address(f[1])}:{int(f[1].rpartition(':')[2], 16)}"
    out = []
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # gone meanwhile
            continue
        out += [(pid, listen[ln[8:-1]]) for ln in links if ln.startswith("socket:[") and ln[8:-1] in listen]
    return out


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_a_one_node_training_listens_on_loopback_only(tmp_path):
    path = _config(tmp_path, "loopback")  # two ranks (DDP over gloo)
    tree = yaml.safe_load(path.read_text())
    tree["train"]["max_steps"] = 100_000  # far longer than the test waits
    path.write_text(yaml.safe_dump(tree))
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)
    partial = cfg.run_dir() / ".02_train.partial"
    proc = _stage(["stage", "train", str(path)])
    try:
        _wait_for_step(partial / "metrics.jsonl", 2)  # every store and process group is up by then
        pids = _descendants(proc.pid)
        sockets = _listening(pids | {proc.pid})
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert len(pids) >= 3, out[-3000:]  # torchrun and its two ranks
    assert sockets, "no listening socket found: the check would pass vacuously"  # the ranks' store, gloo's
    assert [s for s in sockets if not _loopback(s[1])] == [], sockets
    assert proc.returncode == 143 and out.strip().splitlines()[-1] == "error: terminated", out[-3000:]
    deadline = time.monotonic() + 30  # a guard: the stage killed torchrun's group before it returned
    while _procs_matching(str(partial)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _procs_matching(str(partial)) == []
