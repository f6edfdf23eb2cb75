"""DDP communication hooks (train.parallel.comm_hook): gradients all-reduced as fp16 or bf16, or
PowerSGD's low-rank approximation with error feedback (torch's own hooks), with the bytes each rank
hands to the all-reduce counted per step, and PowerSGD's state kept in checkpoints.

Bytes are the payload this rank all-reduces (what the hook passes to the collective), not wire
bytes: a ring all-reduce of n ranks sends 2(n-1)/n of that per rank whatever the hook.

PowerSGD's state (the error feedback and the warm-started Q factors) is kept by torch per gradient
*bucket*, and DDP rebuilds its buckets after the first backward of every process, so a state saved
by one process would not fit the next one's first buckets. Here it is handled per parameter: at the
start of each backward pass (all earlier passes' futures have completed by then) the state is seen
as per-parameter views, and a bucket whose parameters differ from those its state was made for gets
its state reassembled from them. The checkpoint holds it per parameter too, for every rank (the
error feedback differs between ranks), so a resume continues exactly.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

log = logging.getLogger(__name__)

HOOKS = ("none", "fp16", "bf16", "powersgd")


def _file(rank: int) -> str:
    return f"comm_hook_rank{rank}.pt"


class CommHook:
    """The configured hook, registered on a DDP module; `take_bytes()` returns (and resets) the bytes
    this rank all-reduced since the last call. For `none` DDP keeps its built-in all-reduce and the
    bytes are the gradients' size per synchronised backward (counted by `count_plain`)."""

    def __init__(self, parallel, ddp, names: dict[int, str]):
        self.kind = parallel.comm_hook
        self.bytes = 0
        self.names = names  # id(parameter) -> llmpipe name
        self.state: psgd.PowerSGDState | None = None
        self.made_for: dict[int, tuple] = {}  # bucket index -> ((name, shape), ...) its PowerSGD state fits
        self.views: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}  # per parameter
        self.pass_start = True
        if self.kind == "powersgd":
            # torch's recommended error feedback and warm start; min_compression_rate 2 (its default)
            self.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=parallel.powersgd_rank,
                                            start_powerSGD_iter=parallel.start_powersgd_iter,
                                            compression_stats_logging_frequency=10**9)
        if self.kind != "none":
            ddp.register_comm_hook(self, CommHook._hook)

    # -- the hook -----------------------------------------------------------------------------------

    def _hook(self, bucket):  # NOTE: no annotation: DDP checks it, and this module's are strings
        buf = bucket.buffer()
        if self.kind in ("fp16", "bf16"):
            self.bytes += buf.numel() * 2
            hook = default_hooks.fp16_compress_hook if self.kind == "fp16" else default_hooks.bf16_compress_hook
            return hook(None, bucket)
        st = self.state
        layout = tuple((self.names[id(p)], tuple(p.shape)) for p in bucket.parameters())
        if self.pass_start:  # every future of the previous backward has completed: views are stable
            self.pass_start = False
            self._take_views()
        if bucket.is_last():
            self.pass_start = True
        idx = bucket.index()
        if st.iter < st.start_powerSGD_iter:
            self.bytes += buf.numel() * buf.element_size()
            return psgd.powerSGD_hook(st, bucket)
        if self.made_for.get(idx) != layout:
            self._assemble(idx, layout, buf)
        before = st.total_numel_after_compression
        fut = psgd.powerSGD_hook(st, bucket)
        self.bytes += (st.total_numel_after_compression - before) * buf.element_size()
        self.made_for[idx] = layout
        return fut

    def count_plain(self, params) -> None:
        """comm_hook none: one synchronised backward all-reduced every gradient (DDP's own bucket
        all-reduce, in the gradients' dtype)."""
        self.bytes += sum(p.numel() * p.element_size() for p in params if p.requires_grad)

    def take_bytes(self) -> int:
        n, self.bytes = self.bytes, 0
        return n

    # -- PowerSGD state per parameter ---------------------------------------------------------------

    def _compressed(self, shape: tuple) -> tuple[bool, int, int, int]:
        """(compressed?, n, m, rank) of a gradient of this shape, as powerSGD_hook decides it."""
        n = shape[0] if shape else 1
        m = math.prod(shape) // n if n else 0
        rank = min(n, m, self.state.matrix_approximation_rank)
        return bool(psgd._should_compress(n, m, rank, self.state.min_compression_rate)[0]), n, m, rank

    def _q_slices(self, layout: tuple) -> list[tuple[str, int, int]]:
        """(name, offset, length) of each compressed parameter's Q in a bucket's Q memory: powerSGD_hook
        lays the Qs out grouped by matrix shape, shapes in order of first appearance."""
        groups: dict[tuple, list[tuple[str, int]]] = {}
        for name, shape in layout:
            compress, n, m, rank = self._compressed(shape)
            if compress:
                groups.setdefault((n, m), []).append((name, m * rank))
        out, offset = [], 0
        for members in groups.values():
            for name, length in members:
                out.append((name, offset, length))
                offset += length
        return out

    def _take_views(self) -> None:
        """Per-parameter views of the current per-bucket state (no copies)."""
        st = self.state
        for idx, layout in self.made_for.items():
            if idx in st.error_dict:
                offset = 0
                for name, shape in layout:
                    numel = math.prod(shape)
                    self.views["error"][name] = st.error_dict[idx][offset:offset + numel]
                    offset += numel
            if idx in st.q_memory_dict:
                for name, offset, length in self._q_slices(layout):
                    self.views["q"][name] = st.q_memory_dict[idx][offset:offset + length]

    def _assemble(self, idx: int, layout: tuple, buf: torch.Tensor) -> None:
        """Give bucket `idx` (now holding `layout`) the state of its parameters: error feedback when
        every parameter has one, the warm-start Qs (and P memory to match) when every compressed one
        has its Q; otherwise the hook starts that part afresh, as in a process's first PowerSGD step."""
        st = self.state
        names = [name for name, _ in layout]
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.pop(idx, None)
        if names and all(n in self.views["error"] for n in names):
            st.error_dict[idx] = torch.cat([self.views["error"][n].reshape(-1) for n in names]).to(buf)
        qs = self._q_slices(layout)
        if qs and all(n in self.views["q"] for n, _, _ in qs):
            st.q_memory_dict[idx] = torch.cat([self.views["q"][n].reshape(-1) for n, _, _ in qs]).to(buf)
            p_len = sum(self._compressed(shape)[1] * self._compressed(shape)[3] for _, shape in layout
                        if self._compressed(shape)[0])
            st.p_memory_dict[idx] = torch.empty(p_len, dtype=buf.dtype, device=buf.device)

    # -- checkpoints --------------------------------------------------------------------------------

    def write(self, folder: Path, rank: int) -> list[Path]:
        """This rank's hook state (PowerSGD only: the others keep none)."""
        if self.state is None:
            return []
        st = self.state
        self._take_views()
        kind, keys, pos, has_gauss, cached = st.rng.get_state()
        body = {"kind": self.kind, "iter": int(st.iter),
                "rng": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "error": {n: v.detach().clone().cpu() for n, v in self.views["error"].items()},
                "q": {n: v.detach().clone().cpu() for n, v in self.views["q"].items()},
                "numel": [int(st.total_numel_before_compression), int(st.total_numel_after_compression)]}
        path = folder / _file(rank)
        torch.save(body, path)
        return [path]

    def read(self, folder: Path, rank: int, world: int, saved_world: int | None) -> None:
        """Restore this rank's hook state; a checkpoint from another world size (or without hook
        state) restarts PowerSGD's error feedback, with a warning."""
        if self.state is None:
            return
        path = folder / _file(rank)
        if saved_world not in (None, world) or not path.is_file():
            why = (f"it was written by {saved_world} ranks, this run has {world}" if path.is_file()
                   else f"{path.name} is not in the checkpoint")
            log.warning("train.parallel.comm_hook=powersgd: error feedback starts afresh (%s)", why)
            return
        body = torch.load(path, map_location="cpu", weights_only=True)
        if body.get("kind") != self.kind:
            log.warning("train.parallel.comm_hook: the checkpoint's hook state is %s's, not %s's: not used",
                        body.get("kind"), self.kind)
            return
        st, r = self.state, body["rng"]
        st.iter = int(body["iter"])
        st.rng.set_state(("MT19937", r["keys"].numpy().astype(np.uint32), r["pos"], r["has_gauss"],
                          r["cached_gaussian"]))
        st.total_numel_before_compression, st.total_numel_after_compression = body["numel"]
        self.views = {"error": dict(body["error"]), "q": dict(body["q"])}
        self.made_for.clear()
        for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
            d.clear()

