"""Kubernetes: a Kubeflow Trainer v2 TrainJob, the training operator's PyTorchJob, or MindCluster's
AscendJob (Volcano), each a pure function of the Job; submitted, followed and deleted through the
`kubernetes` Python client (the optional extra `cluster`).

Every pod runs llmpipe.train.cluster.node, which reads its node rank and the first pod's address from
what the operator sets (Trainer's PET_*, the operators' MASTER_ADDR / RANK) and becomes torchrun.
The artifacts folder is a ReadWriteMany claim (train.cluster.volume_claim) mounted at shared_dir.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from pathlib import Path

from llmpipe import device as dev
from llmpipe.errors import ConfigError, StageError
from llmpipe.train.cluster import spec
from llmpipe.train.cluster.spec import Job

# (apiVersion, kind, plural) of each job kind
KINDS = {"trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob", "trainjobs"),
         "pytorchjob": ("kubeflow.org/v1", "PyTorchJob", "pytorchjobs"),
         "ascendjob": ("mindxdl.gitee.com/v1", "AscendJob", "ascendjobs")}
# the label each operator puts on its pods, to find them
POD_LABEL = {"trainjob": "jobset.sigs.k8s.io/jobset-name", "pytorchjob": "training.kubeflow.org/job-name",
             "ascendjob": "job-name"}
VOLUME = "artifacts"
MANAGER = "llmpipe"


def _env(j: Job) -> list[dict]:
    return [{"name": k, "value": v} for k, v in sorted(j.env.items())]


def _resources(j: Job) -> dict:
    name = dev.cluster_resource(j.accelerator)
    if not name or not j.devices_per_node:
        return {}
    return {"limits": {name: j.devices_per_node}, "requests": {name: j.devices_per_node}}


def _mount(j: Job) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): the shared artifacts claim at the nodes' artifacts path."""
    claim = j.cluster.volume_claim
    if not claim:
        return [], []
    root = j.cluster.shared_dir or str(Path(j.out).parents[1])  # out = <artifacts>/<run>/<partial>
    return ([{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}],
            [{"name": VOLUME, "mountPath": root}])


def _container(j: Job, name: str, scheduler: str, job_id: str) -> dict:
    volumes, mounts = _mount(j)
    c = {"name": name, "image": j.cluster.image, "command": spec.node_argv(j, scheduler, job_id), "env": _env(j)}
    if _resources(j):
        c["resources"] = _resources(j)
    if mounts:
        c["volumeMounts"] = mounts
    return c


def trainjob(j: Job, job_id: str) -> dict:
    """Kubeflow Trainer v2: numNodes pods of the runtime (torch-distributed), each running the node entry;
    the claim mounted through a runtime patch of its "node" job."""
    trainer = {"image": j.cluster.image, "command": spec.node_argv(j, "kubeflow", job_id), "env": _env(j),
               "numNodes": j.nodes, "numProcPerNode": j.nproc_per_node}
    if _resources(j):
        trainer["resourcesPerNode"] = _resources(j)
    body: dict = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                 "name": j.cluster.runtime}, "trainer": trainer}
    volumes, mounts = _mount(j)
    if volumes:
        pod = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
        body["runtimePatches"] = [{"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
            "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]
    return _object("trainjob", j, job_id, body)


def _replica(j: Job, n: int, container: dict, labels: dict | None = None) -> dict:
    volumes, _ = _mount(j)
    pod: dict = {"containers": [copy.deepcopy(container)]}  # each replica its own (no YAML anchors)
    if volumes:
        pod["volumes"] = volumes
    template: dict = {"spec": pod}
    if labels:
        template["metadata"] = {"labels": dict(labels)}
    return {"replicas": n, "restartPolicy": "Never", "template": template}


def pytorchjob(j: Job, job_id: str) -> dict:
    """The training operator's PyTorchJob (v1): a Master and nodes - 1 Workers; the operator sets
    MASTER_ADDR (the Master's service) and RANK (the replica's index)."""
    c = _container(j, "pytorch", "kubeflow", job_id)
    replicas = {"Master": _replica(j, 1, c)}
    if j.nodes > 1:
        replicas["Worker"] = _replica(j, j.nodes - 1, c)
    return _object("pytorchjob", j, job_id, {"nprocPerNode": str(j.nproc_per_node), "pytorchReplicaSpecs": replicas,
                                             "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0}})


def ascendjob(j: Job, job_id: str) -> dict:
    """MindCluster's AscendJob under Volcano (gang-scheduled: every node or none); ascend-operator sets
    MASTER_ADDR, MASTER_PORT and RANK, and writes the rank table HCCL reads. The container is named
    "ascend" and its port "ascendjob-port", as the operator requires."""
    c = _container(j, "ascend", "ascend", job_id)
    c["ports"] = [{"containerPort": j.port, "name": "ascendjob-port"}]
    resource = dev.cluster_resource(j.accelerator)
    if resource:  # the devices Volcano gave the pod, for Ascend's container runtime
        c["env"] = c["env"] + [{"name": "ASCEND_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{resource}']"}}}]
    ring = {"ring-controller.atlas": dev.ascend_ring(j.accelerator)} if dev.ascend_ring(j.accelerator) else {}
    replicas = {"Master": _replica(j, 1, c, ring)}
    if j.nodes > 1:
        replicas["Worker"] = _replica(j, j.nodes - 1, c, ring)
    body = {"schedulerName": "volcano", "successPolicy": "AllWorkers", "replicaSpecs": replicas,
            "runPolicy": {"schedulingPolicy": {"minAvailable": j.nodes, "queue": j.cluster.queue}}}
    return _object("ascendjob", j, job_id, body, labels={"framework": "pytorch", **ring})


def _object(api: str, j: Job, job_id: str, body: dict, labels: dict | None = None) -> dict:
    version, kind, _ = KINDS[api]
    meta = {"name": job_id, "namespace": j.cluster.namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGER, **(labels or {})}}
    return {"apiVersion": version, "kind": kind, "metadata": meta, "spec": body}


RENDER = {"trainjob": trainjob, "pytorchjob": pytorchjob, "ascendjob": ascendjob}


def manifest(j: Job, job_id: str | None = None) -> dict:
    """train.cluster.api's manifest for the Job, named `job_id` (default: the Job's name)."""
    return RENDER[j.cluster.api](j, job_id or j.name)


# -- the client ---------------------------------------------------------------------------------------


def _client():
    """The kubernetes client configured from kubeconfig or the pod's service account; ConfigError in one
    line when it is not installed or no cluster is reachable."""
    try:
        import kubernetes as k8s
    except ImportError:
        raise ConfigError("train.launcher: kubernetes needs the kubernetes package (pip install "
                          "'llmpipe[cluster]'); `llmpipe job CONFIG --dry-run` prints the manifest") from None
    try:
        try:
            k8s.config.load_incluster_config()
        except k8s.config.ConfigException:
            k8s.config.load_kube_config()
    except Exception as err:  # no kubeconfig, a broken one: the client's own exceptions vary
        raise ConfigError(f"train.launcher: kubernetes, but no cluster is reachable ({str(err).splitlines()[0]}); "
                          "`llmpipe job CONFIG --dry-run` prints the manifest") from None
    return k8s


def check(cfg) -> None:
    """Before anything trains: the client installed, a cluster answering, the namespace there."""
    k8s = _client()
    try:
        k8s.client.CoreV1Api().read_namespace(cfg.train.cluster.namespace, _request_timeout=20)
    except k8s.client.ApiException as err:
        if err.status == 404:
            raise ConfigError(f"train.cluster.namespace: {cfg.train.cluster.namespace!r} does not exist") from None
        raise ConfigError(f"train.launcher: kubernetes: the cluster refused ({err.status} {err.reason})") from None
    except Exception as err:  # urllib3's connection errors
        raise ConfigError(f"train.launcher: kubernetes, but no cluster is reachable ({str(err).splitlines()[0]})") \
            from None


_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")


def launch(cfg, j: Job, out: Path, log) -> dict:
    """Create the job, follow its pods (the first pod's log into `log`) to the job's end, delete it
    when interrupted."""
    import yaml

    k8s = _client()
    job_id = f"{j.name[:55]}-{uuid.uuid4().hex[:6]}"  # unique per attempt: an old job may still be there
    body = manifest(j, job_id)
    spec.write_description(out, f"{job_id}.yaml", yaml.safe_dump(body, sort_keys=False))
    version, kind, plural = KINDS[j.cluster.api]
    group, _, ver = version.partition("/")
    api = k8s.client.CustomObjectsApi()
    ns = j.cluster.namespace
    try:
        api.create_namespaced_custom_object(group, ver, ns, plural, body)
    except k8s.client.ApiException as err:
        raise StageError(f"train.launcher=kubernetes: the cluster refused the {kind}: {err.status} {err.reason}") \
            from None
    try:  # from here on, an interrupt deletes the job
        (out / spec.FOLDER / spec.RECORD).write_text(json.dumps(
            {"scheduler": "kubernetes", "kind": kind, "namespace": ns, "job_id": job_id, "submitted_at": time.time()}))
        log.info("created %s %s/%s", kind, ns, job_id)
        return _follow(cfg, k8s, j, job_id, out, log)
    except BaseException:
        log.info("deleting %s %s/%s", kind, ns, job_id)
        api.delete_namespaced_custom_object(group, ver, ns, plural, job_id, propagation_policy="Foreground")
        raise


def _conditions(obj: dict) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in (obj.get("status") or {}).get("conditions") or []}


def _follow(cfg, k8s, j: Job, job_id: str, out: Path, log) -> dict:
    version, _, plural = KINDS[j.cluster.api]
    group, _, ver = version.partition("/")
    api, core, ns = k8s.client.CustomObjectsApi(), k8s.client.CoreV1Api(), j.cluster.namespace
    gate = spec.Gate(out / spec.FOLDER, job_id, j.nodes, j.wait_s, j.out)
    shown = 0
    while True:
        obj = api.get_namespaced_custom_object(group, ver, ns, plural, job_id)
        pods = core.list_namespaced_pod(ns, label_selector=f"{POD_LABEL[j.cluster.api]}={job_id}").items
        for pod in pods:
            for st in pod.status.container_statuses or []:
                waiting = st.state.waiting.reason if st.state and st.state.waiting else None
                if waiting in _PULL:
                    raise StageError(f"train.cluster.image: {j.cluster.image!r} cannot be pulled ({waiting} on "
                                     f"pod {pod.metadata.name})")
        running = bool(pods) and all(p.status.phase == "Running" for p in pods)
        err = gate.check(running, log)
        if err is not None:
            raise err
        first = sorted(p.metadata.name for p in pods if p.status.phase in ("Running", "Succeeded", "Failed"))
        if first:  # the first pod's log; the lines not shown yet
            text = core.read_namespaced_pod_log(first[0], ns)
            lines = text.splitlines()
            for line in lines[shown:]:
                log.info("%s", line)
            shown = len(lines)
        cond = _conditions(obj)
        if cond.get("Failed") == "True":
            raise StageError(f"{obj['kind']} {ns}/{job_id} failed (kubectl describe {plural} -n {ns} {job_id})")
        if cond.get("Succeeded") == "True" or cond.get("Complete") == "True":
            return {"kubernetes_job": f"{ns}/{job_id}"}
        time.sleep(cfg.train.cluster.poll_s)
