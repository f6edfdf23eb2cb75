"""LoRA at consolidate: the adapters merged into their weights, and the adapter alone in PEFT's format.

    adapter/adapter_config.json         PEFT's LoraConfig: r, lora_alpha, lora_dropout, target_modules
                                        (Hugging Face names: q_proj ... down_proj), bias "none",
                                        task_type CAUSAL_LM, base_model_name_or_path (model.init_from)
    adapter/adapter_model.safetensors   lora_A / lora_B under the names PEFT saves for LlamaForCausalLM,
                                        base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight

so `peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), "adapter")` is the merged
model (PEFT computes W x + scale B A x, the merge W + scale B A: equal to rounding). The merge runs
inside each format's streaming consolidator (`Merge` is their `transform`), one weight at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from llmpipe.models.llama import hf
from llmpipe.models.llama.lora import ADAPTER_PARTS, LoraSpec, is_adapter, merged

ADAPTER_DIR = "adapter"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT = {".lora_a.weight": ".lora_A.weight", ".lora_b.weight": ".lora_B.weight"}


def peft_name(name: str) -> str:
    """llmpipe's adapter name -> PEFT's saved key for LlamaForCausalLM."""
    part = next(p for p in ADAPTER_PARTS if name.endswith(p))
    base = hf.to_hf_name(name.removesuffix(part) + ".weight").removesuffix(".weight")
    return f"base_model.model.{base}{_PEFT[part]}"


def peft_config(spec: LoraSpec, base_model: str | None) -> dict:
    """adapter_config.json (PEFT's LoraConfig fields; the rest take PEFT's defaults)."""
    modules = [hf.to_hf_name(f"layers.0.{t}.weight").split(".")[-2] for t in _module_paths(spec)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None}


def _module_paths(spec: LoraSpec) -> list[str]:
    from llmpipe.models.llama.lora import TARGETS

    return [f"{TARGETS[t]}.{t}" for t in spec.targets]


class Merge:
    """A consolidator's `transform`: the stored tensors as the merged model (llmpipe.models.llama.lora
    .merged), keeping the adapters it reads on the way (small: rank x (in + out) per layer) for
    `write_adapter`."""

    def __init__(self, spec: LoraSpec):
        self.spec, self.adapters = spec, {}

    def __call__(self, shapes: dict[str, tuple[int, ...]], load):
        for name in shapes:
            if is_adapter(name) and name not in self.adapters:
                self.adapters[name] = load(name).float().contiguous().clone()
        return merged(shapes, load, self.spec.scale)

    def write_adapter(self, folder: Path, base_model: str | None) -> Path:
        """The adapter in PEFT's folder format under `folder`/adapter (returned)."""
        out = Path(folder) / ADAPTER_DIR
        out.mkdir()
        save_file({peft_name(n): t for n, t in sorted(self.adapters.items())}, str(out / WEIGHTS),
                  metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(peft_config(self.spec, base_model), indent=2) + "\n")
        return out

