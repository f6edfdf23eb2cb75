"""llmpipe: raw text -> trained LLaMA-style model -> ONNX / OM -> benchmark. Never imports prefect."""

__version__ = "0.1.0"
