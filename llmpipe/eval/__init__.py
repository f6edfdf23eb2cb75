"""Evaluation on downstream tasks: lm-evaluation-harness over llmpipe's engines (the evaluate stage)."""
