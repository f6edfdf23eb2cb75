"""ais_bench.infer: the stand-in's copy of the real package's layout (see ais_bench/__init__.py)."""
