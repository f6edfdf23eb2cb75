"""What the train stage's fingerprint hashes beyond its result-defining config fields."""

from __future__ import annotations

from llmpipe.optim import global_batch


def extra(cfg) -> dict:
    """The global batch: its factors (micro-batch, accumulation, replicas) are layout, so operational,
    but their product defines the result (unknown when the hostfile cannot be read here: then the
    config's own numbers stand). A compressing DDP comm hook and its settings. A chat run's data.packing.
    And with
    model.init_from, the pretrained weights' identity (headers and sizes of its files,
    llmpipe.models.llama.hf.weights_identity)."""
    from llmpipe.train.launch import launch_world

    launch = launch_world(cfg)
    out: dict = {"global_batch": global_batch(cfg, launch[0] if launch else cfg.train.nproc_per_node)}
    p = cfg.train.parallel
    if p.comm_hook != "none":  # compressed gradients change the result (none keeps older fingerprints)
        out["comm_hook"] = p.comm_hook
        if p.comm_hook == "powersgd":
            out["powersgd"] = [p.powersgd_rank, p.start_powersgd_iter]
    if cfg.data.format == "chat":  # how conversations become sequences is training's, not in the shards' bytes
        out["chat_packing"] = cfg.data.packing
    if cfg.model.init_from:
        from llmpipe.models.llama.hf import weights_identity

        out["init_from"] = weights_identity(cfg.model.init_from)
    return out
