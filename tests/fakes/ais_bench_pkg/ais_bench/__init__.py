"""A stand-in for Ascend's `ais_bench` package, for tests only.

The real ais_bench (https://gitee.com/ascend/tools/tree/master/ais-bench_workload/tool/ais_bench)
runs .om models on an Ascend NPU through its `aclruntime` backend, which needs the CANN runtime and
an NPU; neither can exist on a CI machine or a laptop. This package offers the same Python interface
(`ais_bench.infer.interface.InferSession`) and "runs" the .om files written by tests/fakes/atc with
onnxruntime on the CPU, so that the tests can check how llmpipe drives ais_bench. It measures nothing
about an NPU.
"""
