"""Issue 22 item 5: a generation measurement that failed on every engine fails the benchmark stage in
one line naming it, instead of completing with a table of errors."""

from __future__ import annotations

import pytest

from llmpipe.bench import llm
from llmpipe.bench import run as bench
from llmpipe.stages import StageError
from tests.unit.test_bench import LLM, _ctx, _inputs


def test_a_prompt_length_no_engine_can_take_fails_the_stage_naming_it(tmp_path):
    # The config's model (tiny, a 1024-slot cache) takes 600-token prompts, so it loads; the model the
    # stage finds (debug: max_seq_len 512, a 48-slot static decoder) does not, in PyTorch or onnxruntime.
    ctx = _ctx(tmp_path, _inputs(tmp_path), variants=["fp32"], shapes=[[1, 16]],
               llm={**LLM, "prompt_lens": [8, 600]})
    with pytest.raises(StageError) as err:
        bench.run(ctx)
    assert str(err.value) == ("benchmark: benchmark.llm.prompt_lens: TTFT at prompt length 600 failed on every "
                              "engine (2 tried; cpu/torch: prompt of 600 tokens + 1 new tokens exceeds the context of "
                              "512 tokens)")
    assert not (ctx.work_dir / "results.json").exists()


def _prefill(variant: str, length: int, ttft: float | None, error: str | None = None) -> dict:
    return {"variant": variant, "provider": "cpu", "batch": 1, "prompt_len": length, "prefill_ms": ttft,
            "ttft_ms": ttft, "error": error}


def test_a_measurement_one_engine_made_or_an_engine_not_tried_does_not_fail_the_stage():
    full = "prompt of 64 tokens does not fit the decoder's cache of 48"
    not_tried = {"variant": "om", "provider": "npu", "error": "not measured: no OM model"}
    results = {"prefill": [_prefill("torch", 64, 3.0), _prefill("fp32", 64, None, full), not_tried], "decode": []}
    assert llm.failed_everywhere(results, [64], []) is None  # torch measured it
    results["prefill"][0] = _prefill("torch", 64, None, "boom")
    assert llm.failed_everywhere(results, [64], []) == ("benchmark.llm.prompt_lens: TTFT at prompt length 64 "
                                                        "failed on every engine (2 tried; cpu/torch: boom)")
    broken = {"variant": "int8", "provider": "cpu", "error": "RuntimeError: cannot open", "engine_failed": True}
    decode = {"decode": [broken], "prefill": [not_tried]}
    assert llm.failed_everywhere(decode, [], [2]) == ("benchmark.llm.batches: TPOT at batch 2 failed on every "
                                                      "engine (1 tried; cpu/int8: RuntimeError: cannot open)")
    assert llm.failed_everywhere({"prefill": [not_tried], "decode": []}, [64], [1]) is None  # nothing was tried
