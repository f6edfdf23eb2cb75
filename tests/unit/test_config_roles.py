"""Every config field is either result-defining (fingerprinted) or operational, by explicit choice;
changing only operational fields leaves every fingerprint as it was."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from llmpipe import config as config_mod
from llmpipe import stages
from llmpipe.config import OPERATIONAL, RESULT, RunConfig, role
from tests.unit.test_stages import _cfg


def _leaves(cls: type[BaseModel], prefix: str = "", inherited: str | None = None):
    """(dotted path, its own role, the role of the nearest operational container) for every leaf."""
    for name, field in cls.model_fields.items():
        own = role(cls, name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield f"{prefix}{name}", own, inherited, True
            yield from _leaves(ann, f"{prefix}{name}.", OPERATIONAL if own == OPERATIONAL else inherited)
        else:
            yield f"{prefix}{name}", own, inherited, False


def test_every_field_chose_its_role_and_operational_sections_hold_only_operational_fields():
    rows = list(_leaves(RunConfig))
    assert len(rows) > 100
    unmarked = [path for path, own, _, _ in rows if own not in (RESULT, OPERATIONAL)]
    assert unmarked == [], f"fields without Res(...)/Op(...): {unmarked}"
    mixed = [path for path, own, inherited, _ in rows if inherited == OPERATIONAL and own != OPERATIONAL]
    assert mixed == [], f"result fields inside an operational section: {mixed}"
    for path, own, _, section in rows:
        if own == OPERATIONAL and not section:
            field = _field(path)
            assert "operational" in (field.description or ""), path  # the description says so


def _field(dotted: str):
    cls: type[BaseModel] = RunConfig
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = cls.model_fields[part].annotation
    return cls.model_fields[leaf]


OPERATIONAL_FIELDS = [  # the issue's list: logging, cadences, retention, timeouts, HCCL, profiler, debug,
    "train.log_every", "train.eval.every_steps", "train.checkpoint.every_steps",  # threads, launcher, layout
    "train.checkpoint.keep_last", "train.dist_timeout_s", "train.hccl.algo", "train.profile.enabled",
    "train.debug.nan_guard", "train.threads_per_proc", "train.hostfile", "train.nproc_per_node",
    "train.parallel.tp", "train.parallel.pp", "train.parallel.data", "train.parallel.bucket_cap_mb",
    "train.activation_checkpointing", "train.micro_batch_size", "train.grad_accum_steps", "run.device",
    "run.retries", "convert_om.timeout_s", "convert_om.log", "train.launcher", "train.cluster.partition",
    "train.cluster.image", "train.cluster.shared_dir",
]
RESULT_FIELDS = [
    "model.flavor", "model.dim", "data.inputs", "data.seq_len", "data.tokenizer.vocab_size", "run.seed",
    "train.max_steps", "train.optim.lr", "train.optim.betas", "train.optim.weight_decay",
    "train.schedule.decay", "train.schedule.warmup_steps", "train.precision.dtype", "export.opset",
    "convert_om.soc_version", "benchmark.variants",
]


def test_the_split_follows_the_issue():
    roles = {path: inherited or own for path, own, inherited, _ in _leaves(RunConfig)}
    assert {p: roles[p] for p in OPERATIONAL_FIELDS} == dict.fromkeys(OPERATIONAL_FIELDS, OPERATIONAL)
    assert {p: roles[p] for p in RESULT_FIELDS} == dict.fromkeys(RESULT_FIELDS, RESULT)


@pytest.mark.parametrize("changes", [
    ["train.log_every=5", "train.dist_timeout_s=900"],
    ["train.hccl.algo=level0:NA", "train.profile.enabled=true", "train.debug.nan_guard=skip"],
    ["train.checkpoint.every_steps=7", "train.checkpoint.keep_last=9", "train.eval.every_steps=3"],
    ["train.activation_checkpointing=true", "train.parallel.bucket_cap_mb=5", "convert_om.timeout_s=60"],
    # the layout: 2 ranks x 4 x 1 = 1 rank x 4 x 2 = 1 rank x 8 x 1 sequences per step
    ["train.nproc_per_node=1", "train.grad_accum_steps=2"],
    ["train.nproc_per_node=1", "train.micro_batch_size=8"],
    ["train.launcher=slurm", "train.cluster.partition=p", "train.cluster.accelerator=cpu"],
])
def test_operational_changes_leave_every_fingerprint_unchanged(tmp_path, changes):
    base = ["train.nproc_per_node=2", "train.micro_batch_size=4", "train.grad_accum_steps=1"]
    assert stages.fingerprints(_cfg(tmp_path, *base)) == stages.fingerprints(_cfg(tmp_path, *base, *changes))


@pytest.mark.parametrize("change", ["train.optim.lr=0.01", "train.max_steps=999", "train.micro_batch_size=2",
                                    "train.nproc_per_node=1", "train.schedule.decay=wsd", "run.seed=7"])
def test_result_changes_move_the_train_fingerprint(tmp_path, change):
    base = ["train.nproc_per_node=2", "train.micro_batch_size=4"]
    a, b = stages.fingerprints(_cfg(tmp_path, *base)), stages.fingerprints(_cfg(tmp_path, *base, change))
    assert a["train"] != b["train"]  # the global batch (micro x accumulation x replicas) moved, or a result field


def test_operational_changes_between_recorded_configs_name_the_fields(tmp_path):
    old = _cfg(tmp_path).to_dict()
    new = _cfg(tmp_path, "train.log_every=5", "train.optim.lr=0.5", "train.parallel.tp=2").to_dict()
    assert config_mod.operational_changes(old, new, ("model", "train", "run.seed")) == {
        "train.log_every": [10, 5], "train.parallel.tp": [1, 2]}


def test_a_config_recorded_before_the_launcher_settings_existed_shows_no_operational_change(tmp_path):
    """train.launcher and train.cluster came later: at their defaults they are no change to record."""
    old = _cfg(tmp_path).to_dict()
    del old["train"]["launcher"], old["train"]["cluster"]
    assert config_mod.operational_changes(old, _cfg(tmp_path).to_dict(), ("train",)) == {}
    assert config_mod.operational_changes(old, _cfg(tmp_path, "train.launcher=slurm").to_dict(), ("train",)) == {
        "train.launcher": [None, "slurm"]}
