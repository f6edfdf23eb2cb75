"""`llmpipe plan --deploy`: weight and KV-cache bytes against LLaMA-7B's known sizes, the decode-time bound,
the device table and its overrides, the benchmark's measured time per output token beside the bound, and
the CLI."""

from __future__ import annotations

import json

import pytest

from llmpipe import cli
from llmpipe import config as config_mod
from llmpipe.models.llama.flavors import FLAVORS
from llmpipe.stages import stage_dir
from llmpipe.tools import plan_deploy
from tests.conftest import ROOT, make_cfg

RECIPE = ROOT / "configs" / "llama7b_64dev.yaml"
TINY = ROOT / "configs" / "tiny.yaml"
GIB = 1 << 30


def _recipe(tmp_path, *overrides: str) -> config_mod.RunConfig:
    return config_mod.load(RECIPE, [f"run.artifacts_dir={tmp_path / 'artifacts'}", *overrides])


# -- formulas ----------------------------------------------------------------------------------------

def test_llama_7b_weights_per_precision():
    a = FLAVORS["llama-7b"]
    w = plan_deploy.weight_bytes(a)
    assert a.num_params() == 6_738_415_616
    assert w["fp32"] == 4 * a.num_params() and w["fp16"] == 2 * a.num_params()
    assert w["fp16"] / 1e9 == pytest.approx(13.5, abs=0.05)  # 6.74e9 params -> 13.5 GB in fp16
    d, f, L, V = 4096, 11008, 32, 32000
    matrices = L * (4 * d * d + 3 * d * f) + V * d  # attention, SwiGLU, output head: int8 + scale + zero point
    fp32_kept = V * d + (2 * L + 1) * d  # the embedding (a Gather) and the RMSNorm weights
    assert w["int8"] == matrices + (7 * L + 1) * 5 + 4 * fp32_kept
    assert w["int8"] / 1e9 == pytest.approx(7.13, abs=0.01)  # the fp32 embedding costs 0.4 GB over 1 B/param


def test_kv_cache_per_sequence_at_4096_tokens_is_2_gib_in_fp16():
    assert plan_deploy.kv_cache_bytes(32, 32, 128, 4096, 2) == 2 * 32 * 32 * 128 * 4096 * 2 == 2 * GIB
    assert plan_deploy.kv_cache_bytes(32, 8, 128, 4096, 4) == GIB  # GQA (8 kv heads) in fp32: 1/4 x 2


def test_decode_bound_reads_weights_and_every_sequence_cache_once():
    assert plan_deploy.decode_bound_s(13.5e9, 2e9, 1, 1000) == pytest.approx(15.5e-3)
    assert plan_deploy.decode_bound_s(13.5e9, 2e9, 8, 1000) == pytest.approx(29.5e-3)


# -- the plan from a config ---------------------------------------------------------------------------

def test_recipe_on_h100_at_4096_tokens(tmp_path):
    d = plan_deploy.deploy(_recipe(tmp_path, "export.kv_cache_len=4096"), "H100-SXM")
    assert (d.device.name, d.device.bandwidth_gbs, d.device.memory_gb, d.kv_dtype) == ("H100-SXM", 3350, 80, "fp16")
    assert d.cache_len == 4096 and d.kv_per_seq == 2 * GIB and d.batches == [1, 4, 8]
    assert d.bound_s["fp16"][1] == pytest.approx((2 * 6_738_415_616 + 2 * GIB) / 3350e9)
    assert d.bound_s["fp16"][8] == pytest.approx((2 * 6_738_415_616 + 8 * 2 * GIB) / 3350e9)
    assert d.fits == {"fp32": True, "fp16": True, "int8": True}  # 27 GB + 17 GB of cache in 80 GB
    assert d.measured is None
    json.dumps(d.to_dict())


def test_cache_len_defaults_to_min_of_max_seq_len_and_1024(tmp_path):
    assert plan_deploy.deploy(_recipe(tmp_path)).cache_len == 1024  # llama-7b: max_seq_len 4096
    cfg = make_cfg(tmp_path, model={"flavor": "debug", "max_seq_len": 256})
    assert plan_deploy.deploy(cfg).cache_len == 256
    short = {"prompt_lens": [32], "decode_prompt_len": 32, "new_tokens": 32}  # prompts that fit 64 slots
    assert plan_deploy.deploy(make_cfg(tmp_path, export={"kv_cache_len": 64}, benchmark={"llm": short})).cache_len == 64


def test_default_target_is_the_configs_soc_and_batches_come_from_the_benchmark(tmp_path):
    cfg = make_cfg(tmp_path, convert_om={"soc_version": "Ascend310P3"}, benchmark={"llm": {"batches": [2, 16]}})
    d = plan_deploy.deploy(cfg)
    assert (d.device.name, d.device.bandwidth_gbs, d.device.memory_gb) == ("Ascend310P3", 204.8, 24)
    assert d.device.precisions == ("fp16", "int8") and d.batches == [2, 16]
    assert "computes in: fp16, int8" in plan_deploy.format_deploy(d)


def test_weights_and_cache_that_do_not_fit(tmp_path):
    cfg = _recipe(tmp_path, "export.kv_cache_len=4096")
    assert plan_deploy.deploy(cfg, "Ascend910B4").fits == {"fp32": False, "fp16": True, "int8": True}  # 32 GB
    assert plan_deploy.deploy(cfg, "Ascend910B4", memory_gib=16).fits["fp16"] is False  # 13.5 GB + 17 GB of cache
    assert "fp32: NO" in plan_deploy.format_deploy(plan_deploy.deploy(cfg, "Ascend910B4"))


# -- the device table --------------------------------------------------------------------------------

def test_table_entries_have_figures_and_sources():
    for name in ("Ascend910B", "Ascend910B1", "Ascend910B4", "Ascend310P3", "Ascend310B", "A100-40GB", "A100-80GB",
                 "H100-SXM", "H100-PCIe", "H200", "L40S"):
        dev = plan_deploy.DEVICES[name]
        assert dev.bandwidth_gbs > 0 and dev.memory_gb > 0 and dev.source and dev.kind in ("npu", "gpu")
    assert "cpu" not in {plan_deploy._key(n) for n in plan_deploy.DEVICES}  # only with a bandwidth given
    assert plan_deploy.find_device("h100 sxm").name == "H100-SXM"
    assert plan_deploy.find_device("ascend910b3").name == "Ascend910B3"


def test_unknown_target_lists_the_known_names(tmp_path):
    with pytest.raises(config_mod.ConfigError) as err:
        plan_deploy.deploy(make_cfg(tmp_path), "Ascend999")
    msg = str(err.value)
    assert msg.startswith("--soc 'Ascend999': no memory bandwidth known for it (known: Ascend910B, ")
    assert "H200, L40S); give --memory-bandwidth-gbs (GB/s)" in msg
    with pytest.raises(config_mod.ConfigError, match="^convert_om.soc_version 'Ascend310P1'"):  # ATC knows it
        plan_deploy.deploy(make_cfg(tmp_path, convert_om={"soc_version": "Ascend310P1"}))
    with pytest.raises(config_mod.ConfigError, match="^--soc 'cpu'"):
        plan_deploy.deploy(make_cfg(tmp_path), "cpu")


def test_bandwidth_given_overrides_the_table_and_sizes_a_cpu(tmp_path):
    cfg = make_cfg(tmp_path)
    table = plan_deploy.deploy(cfg, "H200")
    given = plan_deploy.deploy(cfg, "H200", bandwidth_gbs=1000)
    assert given.device.bandwidth_gbs == 1000 and given.device.memory_gb == 141  # memory stays the table's
    assert given.bound_s["fp16"][4] == pytest.approx(table.bound_s["fp16"][4] * 4800 / 1000)
    cpu = plan_deploy.deploy(cfg, "cpu", bandwidth_gbs=50)
    assert (cpu.device.kind, cpu.kv_dtype, cpu.device.memory_gb, cpu.fits["fp32"]) == ("cpu", "fp32", None, None)
    a = FLAVORS["debug"]
    assert cpu.kv_per_seq == 2 * a.n_layers * a.n_kv_heads * a.head_dim * cpu.cache_len * 4  # fp32 on a CPU
    with pytest.raises(config_mod.ConfigError, match="memory-bandwidth-gbs must be > 0"):
        plan_deploy.deploy(cfg, "cpu", bandwidth_gbs=0)


# -- measured time per output token -------------------------------------------------------------------

def _write_results(cfg, results) -> None:
    folder = stage_dir(cfg.run_dir(), "benchmark")
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results) if not isinstance(results, str) else results)


def test_measured_tpot_beside_the_bound(tmp_path):
    cfg = make_cfg(tmp_path)
    _write_results(cfg, {"llm": {"cache_len": 1024, "decode": [
        {"variant": "fp16", "provider": "cpu", "batch": 4, "tpot_ms": 2.5, "decode_tokens_per_s": 1600.0,
         "error": None},
        {"variant": "om", "provider": "npu", "batch": 1, "tpot_ms": None, "decode_tokens_per_s": None,
         "error": "ais_bench not found"},
        {"variant": "int8", "provider": "cpu", "batch": 3, "tpot_ms": 1.0},  # a batch the plan does not have
        {"variant": "fp32", "provider": "cpu"},  # no batch: skipped
    ]}})
    d = plan_deploy.deploy(cfg, "Ascend910B")
    assert [(m.variant, m.batch, m.tpot_ms) for m in d.measured] == [("fp16", 4, 2.5), ("om", 1, None),
                                                                     ("int8", 3, 1.0)]
    fp16, om, odd = d.measured
    assert fp16.bound_ms == pytest.approx(1e3 * d.bound_s["fp16"][4])
    assert om.bound_ms == pytest.approx(1e3 * d.bound_s["fp16"][1]) and om.error == "ais_bench not found"
    assert odd.bound_ms is None
    text = plan_deploy.format_deploy(d)
    assert f"fp16     cpu          4 {2.5:9.4g} ms {plan_deploy._ms(fp16.bound_ms / 1e3)}" in text
    assert "(ais_bench not found)" in text
    assert "NOTE: measured on cpu, the bound is for Ascend910B (npu): not comparable" in text
    assert "NOTE: the benchmark ran with a 1024-token cache, the plan with 512" in text  # debug: min(512, 1024)


@pytest.mark.parametrize("results", ["{not json", {"llm": "nothing"}, {"other": 1}, {"llm": {"decode": None}}, []])
def test_a_results_file_without_decode_rows_is_no_measurement(tmp_path, results):
    cfg = make_cfg(tmp_path)
    _write_results(cfg, results)
    d = plan_deploy.deploy(cfg)
    assert d.measured == []
    assert "measured   no decode measurement in" in plan_deploy.format_deploy(d)


# -- the CLI -------------------------------------------------------------------------------------------

def test_cli_deploy_table_and_json(tmp_path, capsys):
    where = f"run.artifacts_dir={tmp_path}"
    assert cli.main(["plan", str(TINY), "--deploy", "--set", where]) == 0
    out = capsys.readouterr().out
    for word in ("target   Ascend910B (npu)", "KV cache (fp16 on npu, 1024 tokens)", "lower bound", "fits 64 GB",
                 "no finished benchmark"):
        assert word in out, word
    assert cli.main(["plan", str(TINY), "--deploy", "--soc", "cpu", "--memory-bandwidth-gbs", "40", "--json",
                     "--set", where]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device"]["bandwidth_gbs"] == 40 and d["kv_dtype"] == "fp32" and d["measured"] is None


@pytest.mark.parametrize("argv, expected", [
    (["--deploy", "--soc", "Ascend999"], "--soc 'Ascend999': no memory bandwidth known for it (known: Ascend910B"),
    (["--deploy", "--bandwidth-gbps", "100"], "with --deploy give the device's memory bandwidth as "
                                              "--memory-bandwidth-gbs"),
    (["--soc", "H200"], "--soc and --memory-bandwidth-gbs size a deployment: add --deploy"),
])
def test_cli_deploy_bad_input_is_one_line(capsys, argv, expected):
    assert cli.main(["plan", str(TINY), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
