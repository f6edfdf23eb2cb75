"""A real one-host Slurm for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm and munge),
configured in a temporary folder, started as root and stopped after. `missing()` says why it cannot be
(the tests then skip and say so)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
PARTITION = "debug"


def _find(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for d in ("/usr/sbin", "/sbin") if (p := Path(d) / name).is_file()),
                                      None)


def missing() -> str | None:
    """Why a local Slurm cannot run here, or None."""
    absent = [n for n in DAEMONS + CLIENTS if _find(n) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found; `apt-get install -y slurm-wlm munge` "
                "installs it, as .ci/run does)")
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root (SlurmUser=root); this is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int = 2) -> str:
    """slurm.conf for one node on this host: no cgroups, no accounting, state in `root`."""
    ctld, slurmd = _free_port(), _free_port()
    return "\n".join([
        "ClusterName=llmpipe-test", "SlurmctldHost=localhost", f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
        # NOTE: cred_expire also delays a requeued job's start (Slurm's default: 120 s); 5 s here (its least)
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={root / 'munge.sock'},cred_expire=5",
        f"StateSaveLocation={root / 'ctld'}", f"SlurmdSpoolDir={root / 'slurmd'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
        # sched_interval: a requeued job waits for the periodic pass (Slurm's default: every 60 s)
        "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=1",
        "MpiDefault=none",
        "ReturnToService=2", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5",
        "MinJobAge=600", "JobRequeue=1",
        f"NodeName={host} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
    ]) + "\n"


class LocalSlurm:
    """Start with start(), stop with stop(); `env` points Slurm's clients at this one (SLURM_CONF)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> LocalSlurm:
        root = self.root
        for sub in ("ctld", "slurmd", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (root / "slurm.conf").write_text(slurm_conf(root, self.host))
        self._spawn([_find("munged"), "--foreground", "--force", f"--socket={root / 'munge.sock'}",
                     f"--key-file={key}", f"--pid-file={root / 'munge' / 'munged.pid'}",
                     f"--log-file={root / 'munge' / 'munged.log'}", f"--seed-file={root / 'munge' / 'seed'}"],
                    "munged.out")
        self._wait(lambda: (root / "munge.sock").exists(), "munged's socket")
        self._spawn([_find("slurmctld"), "-D", "-i", "-f", str(root / "slurm.conf")], "slurmctld.out")
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), "slurmctld")
        self._spawn([_find("slurmd"), "-D", "-f", str(root / "slurm.conf"), "-N", self.host], "slurmd.out")
        self._wait(lambda: self._ok(["sinfo", "-h", "-o", "%t"], "idle"), "slurmd (node idle)")
        return self

    def _spawn(self, argv: list, log: str) -> None:
        out = open(self.root / log, "ab")  # noqa: SIM115 (the daemon holds it)
        self.procs.append(subprocess.Popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))
        out.close()

    def _ok(self, argv: list[str], text: str) -> bool:
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=20)
        return res.returncode == 0 and text in res.stdout

    def _wait(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            if ready():
                return
            time.sleep(0.3)
        logs = "; ".join(f"{f.name}: {f.read_text(errors='replace')[-400:]}" for f in self.root.glob("*.out"))
        self.stop()
        raise RuntimeError(f"the local Slurm did not start ({what}): {logs}")

    def squeue(self) -> list[str]:
        res = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, capture_output=True, text=True,
                             timeout=20)
        return res.stdout.split("\n")[:-1] if res.stdout else []

    def cancel_all(self, wait_s: float = 60) -> None:
        """scancel every job and wait until squeue lists none (what a failed test left)."""
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=20)
        deadline = time.monotonic() + wait_s
        while self.squeue() and time.monotonic() < deadline:
            time.sleep(0.3)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True, timeout=20)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []
