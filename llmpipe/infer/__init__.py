"""The inference runtime every consumer shares (export's parity, the benchmark, generate; serve and
evaluate next): the ONNX graph contract (graphs.py: file names, cache length, input names), the
decoding engines over torch, onnxruntime and OM (decode.py, ort.py, ais.py) and their statistics
(stats.py). It never imports a stage: the stages import it."""
