"""The cluster launchers' pure builders (no scheduler needed): the sbatch script and argv, and the seed's
8 x 8 recipe as a TrainJob, PyTorchJob and AscendJob that validate against the CRDs' published OpenAPI
v3 schemas (tests/fixtures/crds/, with their sources); the launcher settings in the config, the planner
and dryrun; no Kubernetes cluster reachable is one line (none is reachable here: the client path is
tested no further)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from llmpipe import cli, preflight, stages
from llmpipe import config as config_mod
from llmpipe.errors import ConfigError
from llmpipe.tools import plan
from llmpipe.train import cluster
from llmpipe.train.cluster import kubernetes, slurm
from tests.unit.test_stages import _cfg

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "llama7b_64dev.yaml"
CRDS = ROOT / "tests" / "fixtures" / "crds"
K8S = ["train.launcher=kubernetes", "train.cluster.image=registry.example.com/llmpipe:0.1",
       "train.cluster.volume_claim=llmpipe-artifacts", "train.cluster.shared_dir=/mnt/artifacts"]


def _recipe(tmp_path, *overrides: str) -> config_mod.RunConfig:
    return config_mod.load(RECIPE, [f"run.artifacts_dir={tmp_path / 'artifacts'}", *overrides])


def _job(cfg) -> cluster.Job:
    out = stages.partial_dir(cfg.run_dir(), "train")
    return cluster.job(cfg, out / "config.yaml", stages.stage_dir(cfg.run_dir(), "prepare_data"), out,
                       python="/opt/venv/bin/python")


def test_the_sbatch_script_runs_one_srun_step_that_starts_the_node_entry_on_each_of_the_8_nodes(tmp_path):
    cfg = _recipe(tmp_path, "train.launcher=slurm", "train.cluster.partition=ascend", "train.cluster.time=2-00:00:00",
                  "train.cluster.env={HF_HOME: /shared/hf cache}")
    j = _job(cfg)
    out = stages.partial_dir(cfg.run_dir(), "train")
    script = slurm.batch_script(j)
    sbatch = [ln.removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    assert sbatch == ["--job-name=llmpipe-llama7b-64dev", "--nodes=8", "--ntasks-per-node=1", "--exclusive",
                      f"--output={out}/cluster/slurm-%j.out", "--open-mode=append", "--requeue", "--gres=npu:8",
                      "--partition=ascend", "--time=2-00:00:00"]
    assert "export HCCL_CONNECT_TIMEOUT=1800" in script.splitlines()  # llmpipe.device's, for NPU
    assert "export HF_HOME='/shared/hf cache'" in script.splitlines()  # quoted for the shell
    steps = [ln for ln in script.splitlines() if "srun" in ln]
    assert len(steps) == 1
    assert slurm.srun_argv(j) == [
        "srun", "--nodes=8", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "/opt/venv/bin/python", "-m",
        "llmpipe.train.cluster.node", "--scheduler", "slurm", "--nodes", "8", "--nproc-per-node", "8", "--port",
        "29500", "--wait-s", "600", "--config", f"{out}/config.yaml", "--data", f"{cfg.run_dir()}/01_prepare_data",
        "--out", str(out)]
    assert slurm.submit_argv(out / "cluster" / "job.sbatch") == ["sbatch", "--parsable",
                                                                 f"{out}/cluster/job.sbatch"]


def test_on_cuda_the_script_asks_for_gpus_and_sets_nccl_from_the_same_network_settings(tmp_path):
    cfg = _recipe(tmp_path, "train.launcher=slurm", "train.cluster.accelerator=cuda",
                  "train.hccl.socket_ifname=ib0", "train.cluster.requeue=false")
    script = slurm.batch_script(_job(cfg))
    assert "#SBATCH --gres=gpu:8" in script and "#SBATCH --no-requeue" in script
    assert "export NCCL_SOCKET_IFNAME=ib0" in script


def _schema(stem: str) -> dict:
    return json.loads((CRDS / f"{stem}.json").read_text())


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob", "ascendjob"])
def test_the_seed_recipe_as_each_kubernetes_job_validates_against_its_crd_schema(tmp_path, api):
    cfg = _recipe(tmp_path, *K8S, f"train.cluster.api={api}")
    manifest = kubernetes.manifest(_job(cfg))
    crd = _schema(api)
    assert manifest["apiVersion"] == f"{crd['group']}/{crd['version']}" and manifest["kind"] == crd["kind"]
    jsonschema.validate(manifest, crd["openAPIV3Schema"])  # raises on the first violation
    text = yaml.safe_dump(manifest)
    assert "&id" not in text  # no YAML anchors: every replica spelled out
    assert "/mnt/artifacts/llama7b-64dev/.02_train.partial" in text


def test_the_manifests_spell_the_8_x_8_layout_as_each_operator_reads_it(tmp_path):
    cfgs = {api: _recipe(tmp_path, *K8S, f"train.cluster.api={api}") for api in kubernetes.KINDS}
    train = kubernetes.manifest(_job(cfgs["trainjob"]))["spec"]
    assert (train["trainer"]["numNodes"], train["trainer"]["numProcPerNode"]) == (8, 8)
    assert train["trainer"]["resourcesPerNode"]["limits"] == {"huawei.com/Ascend910": 8}
    assert train["runtimeRef"]["name"] == "torch-distributed"
    torch_job = kubernetes.manifest(_job(cfgs["pytorchjob"]))["spec"]
    assert {k: v["replicas"] for k, v in torch_job["pytorchReplicaSpecs"].items()} == {"Master": 1, "Worker": 7}
    assert torch_job["nprocPerNode"] == "8"
    ascend = kubernetes.manifest(_job(cfgs["ascendjob"]))
    assert ascend["spec"]["schedulerName"] == "volcano"
    assert ascend["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 8, "queue": "default"}
    assert ascend["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    pod = ascend["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert pod["name"] == "ascend" and pod["ports"] == [{"containerPort": 29500, "name": "ascendjob-port"}]


def test_the_schemas_catch_a_manifest_that_breaks_them(tmp_path):
    """The validation can fail: a node count written as text is refused."""
    manifest = kubernetes.manifest(_job(_recipe(tmp_path, *K8S)))
    manifest["spec"]["trainer"]["numNodes"] = "8"
    with pytest.raises(jsonschema.ValidationError, match="'8' is not of type 'integer'"):
        jsonschema.validate(manifest, _schema("trainjob")["openAPIV3Schema"])


def test_no_kubernetes_cluster_reachable_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = _recipe(tmp_path, *K8S)
    with pytest.raises(ConfigError) as info:
        cluster.check(cfg)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(("train.launcher: kubernetes, but no cluster is reachable (",
                            "train.launcher: kubernetes needs the kubernetes package"))
    assert line.endswith("`llmpipe job CONFIG --dry-run` prints the manifest")


def test_llmpipe_job_dry_run_prints_the_description_the_stage_would_submit(tmp_path, capsys):
    args = ["job", str(RECIPE), "--set", f"run.artifacts_dir={tmp_path}", "--set", "train.launcher=slurm",
            "--dry-run"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == slurm.batch_script(cluster.job(
        _recipe(tmp_path.parent, f"run.artifacts_dir={tmp_path}", "train.launcher=slurm"),
        stages.partial_dir(tmp_path / "llama7b-64dev", "train") / "config.yaml",
        tmp_path / "llama7b-64dev" / "01_prepare_data", stages.partial_dir(tmp_path / "llama7b-64dev", "train")))


def test_the_launcher_settings_change_no_fingerprint(tmp_path):
    local = stages.fingerprints(_cfg(tmp_path))
    assert stages.fingerprints(_cfg(tmp_path, "train.launcher=slurm", "train.cluster.partition=p",
                                    "train.cluster.accelerator=cpu")) == local
    assert stages.fingerprints(_cfg(tmp_path, "train.launcher=kubernetes", "train.cluster.image=i",
                                    "train.cluster.api=ascendjob")) == local


@pytest.mark.parametrize(("override", "message"), [
    ("train.cluster.time=3 days", "config: train.cluster.time: not a Slurm time (minutes, h:m:s or d-h:m:s) "
                                  "(got '3 days')"),
    ("train.cluster.env={1X: y}", "config: train.cluster.env: '1X' is not an environment variable name (got {...})"),
    ("train.cluster.namespace=Team_A", "config: train.cluster.namespace: not a Kubernetes name (lower-case letters, "
                                       "digits, '-') (got 'Team_A')"),
])
def test_a_bad_cluster_setting_is_one_line_naming_it(tmp_path, override, message):
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, "train.launcher=slurm", override)
    assert str(info.value) == message


def test_kubernetes_without_an_image_and_slurm_with_a_hostfile_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="launcher=kubernetes needs train.cluster.image"):
        _cfg(tmp_path, "train.launcher=kubernetes")
    with pytest.raises(ConfigError, match="launcher=slurm starts torchrun on every node itself; train.hostfile"):
        _cfg(tmp_path, "train.launcher=slurm", "train.hostfile=hosts")


def test_the_planner_sizes_the_jobs_world_and_refuses_another(tmp_path):
    cfg = _recipe(tmp_path, "train.launcher=slurm")  # the recipe: 8 nodes x 8
    assert plan.plan(cfg).world_size == 64
    with pytest.raises(ConfigError, match=r"^--world-size 32, but train.launcher slurm starts train.nodes 8 x "
                                          r"train.nproc_per_node 8 = 64 processes$"):
        plan.plan(cfg, 32)
    few = _recipe(tmp_path, "train.launcher=slurm", "train.nodes=4")
    with pytest.raises(Exception, match="32"):  # dp8 x tp4 x pp2 = 64 on 4 x 8 = 32 processes
        plan.plan(few)


def test_prefect_yaml_s_cluster_deployments_load_their_config_with_the_launcher_and_the_8_x_8_world(tmp_path):
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    found = {d["name"]: d for d in spec["deployments"] if d["name"].startswith("cluster-")}
    assert {name: d["work_pool"]["name"] for name, d in found.items()} == {
        "cluster-slurm": "llmpipe-login", "cluster-kubernetes": "llmpipe-k8s"}
    for name, d in found.items():
        overrides = [o for o in d["parameters"]["overrides"] if not o.startswith("run.artifacts_dir=")]
        cfg = config_mod.load(ROOT / d["parameters"]["config"], [*overrides, f"run.artifacts_dir={tmp_path}"])
        assert cfg.train.launcher == name.removeprefix("cluster-")
        assert plan.plan(cfg).world_size == 64


def test_no_sbatch_on_path_is_one_line_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without Slurm's clients
    cfg = _cfg(tmp_path, "train.launcher=slurm")
    with pytest.raises(ConfigError) as info:
        preflight.check_before_run(cfg, ["prepare_data", "train"], force=False, source="cfg.yaml")
    assert str(info.value) == ("cfg.yaml: train.launcher: slurm, but sbatch is not on PATH (run on a Slurm login "
                               "node)")
