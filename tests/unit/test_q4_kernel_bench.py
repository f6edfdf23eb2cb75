"""benchmarks/q4_kernel.py: the hand-written 4-bit GEMV computes what onnxruntime's MatMulNBits computes on the
same weights (both against the fp32 product of the dequantised weights), and its own check catches a kernel
fed the wrong layout."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import q4_kernel  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not q4_kernel.cpu_has("avx2", "fma", "f16c"),
                                reason="the kernel needs a C compiler and an AVX2/FMA/F16C CPU")


def test_kernel_matches_matmulnbits_on_the_same_weights(tmp_path):
    out = tmp_path / "q4.json"
    assert q4_kernel.main(["--layers", "1", "--threads", "1,2", "--rounds", "1", "--reps", "1",
                           "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == 576 * 576 * 2 + 192 * 576 * 2 + 1536 * 576 * 3
    for row in result["rows"].values():
        # measured: MLAS 4.8e-3, the kernel 4.9e-3 (int8 activations per block of 32 in both; fp16 d and m)
        assert 0 < row["mlas"]["rel_error"] < 1e-2
        assert 0 < row["q4_gemv"]["rel_error"] < 1e-2
        # the op inside onnxruntime computes exactly what the kernel alone does (the same code, the same rows)
        assert row["q4_op"]["rel_error"] == pytest.approx(row["q4_gemv"]["rel_error"], rel=1e-6)
        assert row["q4_gemv"]["ms_median"] > 0 and row["ratio"] > 0


def test_a_kernel_fed_the_wrong_row_order_is_caught(monkeypatch, capsys):
    pack = q4_kernel.native.pack

    def scrambled(*args, **kw):  # each tile's scales no longer follow its rows
        q, d, m = pack(*args, **kw)
        return q, d[..., ::-1].copy(), m[..., ::-1].copy()

    monkeypatch.setattr(q4_kernel.native, "pack", scrambled)
    assert q4_kernel.main(["--layers", "1", "--threads", "1", "--rounds", "1", "--reps", "1"]) == 1
    assert "more than twice MLAS's" in capsys.readouterr().err
