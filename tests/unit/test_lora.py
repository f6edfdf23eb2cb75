"""LoRA without processes: train.lora's config errors and fingerprint, the adapted model (starting as
the base, only adapters trainable and optimised), the merge, PEFT's names and the planner's counts."""

from __future__ import annotations

import pytest
import torch

from llmpipe import config as config_mod
from llmpipe import stages
from llmpipe.checkpoint.adapter import peft_name
from llmpipe.models.llama import lora
from llmpipe.models.llama.model import ModelArgs, Transformer
from tests.conftest import make_cfg

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=32)
SPEC = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))


@pytest.mark.parametrize("lora_section,message", [
    ({"rank": 0}, "train.lora.rank: Input should be greater than 0 (got 0)"),
    ({"alpha": -1}, "train.lora.alpha: Input should be greater than 0 (got -1)"),
    ({"dropout": 1.0}, "train.lora.dropout: Input should be less than 1 (got 1.0)"),
    ({"targets": ["wq", "q_proj"]}, "train.lora.targets: 'q_proj' names no linear layer of the model (they are "
                                    "wq, wk, wv, wo, w1, w2, w3) (got ['wq', 'q_proj'])"),
    ({"targets": []}, "train.lora.targets: List should have at least 1 item after validation, not 0 (got [])"),
])
def test_bad_lora_settings_are_one_config_error_naming_the_field(tmp_path, lora_section, message):
    with pytest.raises(config_mod.ConfigError) as err:
        make_cfg(tmp_path, train__lora=lora_section)
    assert str(err.value) == f"config: {message}"


def test_lora_with_tensor_or_pipeline_parallel_is_refused_at_load(tmp_path):
    with pytest.raises(config_mod.ConfigError) as err:
        make_cfg(tmp_path, train__lora={}, train__parallel={"tp": 2})
    assert str(err.value) == ("config: train.lora: LoRA trains with data parallelism only (ddp, fsdp, zero), not "
                              "with train.parallel.tp=2 x pp=1; set both to 1")


def test_lora_dropout_with_activation_checkpointing_is_refused_at_load(tmp_path):
    with pytest.raises(config_mod.ConfigError) as err:
        make_cfg(tmp_path, train__lora={"dropout": 0.1}, train__activation_checkpointing=True)
    assert str(err.value) == ("config: train.lora.dropout=0.1 does not work with train.activation_checkpointing (its "
                              "recompute draws other dropout masks); set one of them to 0 / false")


def test_no_lora_leaves_the_train_fingerprint_as_it_was_and_lora_moves_it(tmp_path):
    plain = make_cfg(tmp_path)
    assert "lora" not in config_mod.result_section(plain, "train")  # what existing runs hashed
    with_lora = make_cfg(tmp_path, train__lora={"rank": 4})
    assert config_mod.result_section(with_lora, "train")["lora"]["rank"] == 4
    assert stages.fingerprints(plain)["train"] != stages.fingerprints(with_lora)["train"]


def test_the_config_names_the_layers_the_model_has():
    assert config_mod.LORA_TARGETS == tuple(lora.TARGETS)


def _models(seed: int = 3) -> tuple[Transformer, Transformer]:
    base = Transformer(ARGS)
    base.init_weights(seed)
    adapted = lora.apply_lora(Transformer(ARGS), SPEC)
    shapes = {n: tuple(p.shape) for n, p in adapted.named_parameters()}
    adapted.init_weights(source=lora.init_source(shapes, seed, dict(base.named_parameters()).__getitem__))
    return base, adapted


def test_an_adapted_model_starts_as_its_base_and_trains_only_the_adapters(tmp_path):
    from llmpipe.optim import build_optimizer

    base, adapted = _models()
    x = torch.randint(0, ARGS.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(base(x), adapted(x))  # B = 0: the update adds exact zeros
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in adapted.named_parameters() if lora.is_adapter(n)]
    assert len(trainable) == 2 * 7 * ARGS.n_layers
    a = dict(adapted.named_parameters())["layers.0.attention.wq.lora_a.weight"]
    assert a.abs().max() <= ARGS.dim ** -0.5 and a.std() > 0  # kaiming-uniform, a = sqrt(5): within 1/sqrt(in)
    opt, _ = build_optimizer(adapted, make_cfg(tmp_path), world=1)
    optimised = {id(p) for g in opt.param_groups for p in g["params"]}
    assert optimised == {id(p) for n, p in adapted.named_parameters() if n in trainable}


def test_merging_gives_the_adapted_models_logits():
    base, adapted = _models()
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if ".lora_b." in n:
                p.normal_(std=0.05)
    state = {n: p.detach().clone() for n, p in adapted.named_parameters()}
    shapes, load = lora.merged({n: tuple(t.shape) for n, t in state.items()}, state.__getitem__, SPEC.scale)
    assert sorted(shapes) == sorted(n for n, _ in base.named_parameters())
    base.load_state_dict({n: load(n) for n in shapes})
    x = torch.randint(0, ARGS.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(base(x), adapted(x), rtol=0, atol=1e-5)


def test_adapters_are_named_as_peft_saves_them_for_llama():
    assert peft_name("layers.1.feed_forward.w2.lora_a.weight") == \
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    assert peft_name("layers.0.attention.wq.lora_b.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("data", ["ddp", "fsdp", "zero"])
def test_the_planner_counts_lora_frozen_weights_without_gradients_or_adamw_state(tmp_path, data):
    from llmpipe.tools.plan import plan

    par = {"data": data, "zero_stage": 3} if data == "zero" else {"data": data}
    full = plan(make_cfg(tmp_path, train__parallel=par), 2).memory
    tuned = plan(make_cfg(tmp_path, train__parallel=par, train__lora={"rank": 8}), 2).memory
    from llmpipe.models.llama import model_args

    cfg = make_cfg(tmp_path)
    a = model_args(cfg.model, vocab_size=cfg.data.tokenizer.vocab_size)  # the debug flavor
    adapters = a.n_layers * lora.block_adapter_params(a, lora.LoraSpec.of({"rank": 8, "alpha": 16, "dropout": 0,
                                                                           "targets": config_mod.LORA_TARGETS}))
    dp = 1 if data == "ddp" else 2
    opt_bytes = 12 if data == "zero" else 8  # ZeRO keeps an fp32 master beside AdamW's two moments
    assert tuned.grads == int(4 / dp * adapters) and tuned.optimizer == int(opt_bytes / dp * adapters)
    assert tuned.params == int(4 / dp * (a.num_params() + adapters))
    assert tuned.params > full.params and tuned.grads < full.grads / 50 and tuned.optimizer < full.optimizer / 50
