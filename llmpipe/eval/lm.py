"""An lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`) over llmpipe's inference engines.

lm_eval asks three things of a model, each a list of requests:

- loglikelihood (context, continuation): lm_eval's own TemplateLM splits the pair into tokens exactly as
  its Hugging Face class (HFLM) does; `_loglikelihood_tokens` then runs the prefill graph (model.onnx, or
  the PyTorch model) on context + continuation, truncated on the left to `max_length` + 1 tokens less the
  last, and sums the log-softmax of the continuation's tokens (float64), with whether each was the argmax;
- loglikelihood_rolling (text): the text in disjoint windows of `max_length` tokens, each conditioned on
  what precedes it (lm_eval.utils.get_rolling_token_windows, as HFLM), the windows' sums added;
- generate_until (context, gen_kwargs): greedy decoding through an engine with a KV cache
  (llmpipe.infer.decode.StaticEngine over the static decoder, or TorchEngine), stopped at eos, at the
  run's chat end-of-turn tokens and at the `until` strings, the text cut before the first of them.

Requests of a batch are right-padded (causal attention never reads the padding). Progress: a tqdm bar
on a terminal, otherwise a log line every `progress_every_s` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

from llmpipe import console

log = logging.getLogger("llmpipe.eval")


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64."""
    x = x.astype(np.float64, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class Progress:
    """Requests done / total: a tqdm bar on a terminal, else a log line every `every_s` seconds."""

    def __init__(self, label: str, total: int, every_s: float):
        self.label, self.total, self.every_s, self.done = label, total, every_s, 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if console.terminal().isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, leave=False, disable=False, file=console.terminal())

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("%s: %d/%d requests (%.0f s)", self.label, self.done, self.total, now - self.t0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class EngineLM(TemplateLM):
    """lm_eval's model interface over one llmpipe variant.

    `logits(ids)`: (B, T) int64 -> (B, T, vocab) float logits of the full prefix pass (the prefill graph);
    `engine`: a decoding engine (start/step, `capacity`) for generate_until; `tokenizer`: the run's
    `tokenizers.Tokenizer`; `eot_id`: eos; `prefix_id`: the token an empty context becomes (HFLM: bos when the
    tokenizer has one, else eos); `stop_ids`: more tokens that end a generation (a chat template's end of turn).
    """

    backend = "causal"

    def __init__(self, name: str, tokenizer, logits: Callable[[np.ndarray], np.ndarray], engine, max_length: int,
                 eot_id: int, prefix_id: int | None = None, stop_ids: Sequence[int] = (), batch_size: int = 1,
                 progress_every_s: float = 30.0):
        super().__init__()
        self.name, self._tok, self._logits, self.engine = name, tokenizer, logits, engine
        self._max_length, self._eot, self._prefix = int(max_length), int(eot_id), prefix_id
        self.stop_ids = list(dict.fromkeys([self._eot, *stop_ids]))
        self._batch, self.every_s = int(batch_size), progress_every_s

    # ---- what TemplateLM needs
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._eot if self._prefix is None else self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return f"llmpipe-{self.name}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # NOTE: as HFLM: None means the tokenizer's own default (its post-processor's special tokens)
        return self._tok.encode(string, add_special_tokens=True if add_special_tokens is None
                                else bool(add_special_tokens)).ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    # ---- loglikelihood
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(input tokens, continuation tokens) per row, scored in one right-padded pass."""
        T = max(len(inp) for inp, _ in rows)
        ids = np.zeros((len(rows), T), np.int64)
        for i, (inp, _) in enumerate(rows):
            ids[i, :len(inp)] = inp
        logits = self._logits(ids)  # (B, T, vocab)
        out = []
        for i, (inp, cont) in enumerate(rows):
            n = len(cont)
            lp = log_softmax(logits[i, len(inp) - n:len(inp)])  # (n, vocab): the positions predicting cont
            greedy = bool((lp.argmax(-1) == np.asarray(cont)).all())
            out.append((float(lp[np.arange(n), cont].sum()), greedy))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None,
                              progress: Progress | None = None) -> list[tuple[float, bool]]:
        own = progress is None
        progress = progress or Progress(f"{self.name} loglikelihood", len(requests), self.every_s)
        results: list[tuple[float, bool]] = []
        batch: list[tuple[list[int], list[int]]] = []
        for _, context_enc, continuation_enc in requests:
            if not continuation_enc:  # nothing to score
                raise ValueError("a loglikelihood request with an empty continuation")
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            batch.append((whole[:-1], list(continuation_enc)[-self.max_length:]))
            if len(batch) == self._batch:
                results += self._score(batch)
                progress.update(len(batch))
                batch = []
        if batch:
            results += self._score(batch)
            progress.update(len(batch))
        if own:
            progress.close()
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (string,) in [r.args for r in requests]:
            rolling = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)))
            windows += [(None, *w) for w in rolling]
            counts.append(len(rolling))
        progress = Progress(f"{self.name} loglikelihood_rolling", len(windows), self.every_s)
        scores = self._loglikelihood_tokens(windows, progress=progress)
        progress.close()
        out, k = [], 0
        for r, n in zip(requests, counts):
            total = sum(s for s, _ in scores[k:k + n])
            k += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return out

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from llmpipe.infer.decode import generate

        eos = self._tok.decode([self._eot], skip_special_tokens=False)
        progress = Progress(f"{self.name} generate_until", len(requests), self.every_s)
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = dict(gen_kwargs or {})
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0:
                log.warning("%s: generate_until asked to sample; llmpipe's evaluation decodes greedily", self.name)
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            max_gen = int(kwargs.get("max_gen_toks") or kwargs.get("max_new_tokens") or 256)
            room = min(self.max_length, self.engine.capacity)
            max_gen = max(1, min(max_gen, room - 1))
            ids = self.tok_encode(context)[-(room - max_gen):] or [self.prefix_token_id]
            new = min(max_gen, self.engine.capacity + 1 - len(ids))
            picked: list[int] = []

            def seen(tokens: np.ndarray, picked=picked) -> None:
                picked.append(int(tokens[0]))

            def stop(picked=picked, until=until) -> bool:
                text = self._tok.decode(picked)
                return any(u and u in text for u in until)

            generate(self.engine, np.array([ids], np.int64), new, lambda x: x.argmax(-1), seen,
                     stop_id=self.stop_ids, stop=stop)
            text = self._tok.decode([t for t in picked if t not in self.stop_ids])
            text = postprocess_generated_text(text, until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            progress.update()
        progress.close()
        return out


# --------------------------------------------------------------------------- engines' logits


def ort_logits(session) -> Callable[[np.ndarray], np.ndarray]:
    """The prefill graph's logits (B, T, vocab) from an onnxruntime session (or an object with its run())."""
    return lambda ids: session.run(["logits"], {"input_ids": ids})[0]


def torch_logits(model) -> Callable[[np.ndarray], np.ndarray]:
    """A llmpipe Transformer's logits (B, T, vocab), fp32, on the CPU."""
    import torch

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return model(torch.from_numpy(ids)).float().numpy()

    return run


class PrefillEngine:
    """Greedy decoding through the prefill graph alone, the whole sequence each token (no KV cache): for a
    run exported without the static decoder (export.static_decoder: false)."""

    def __init__(self, logits: Callable[[np.ndarray], np.ndarray], capacity: int):
        self.logits, self.capacity, self.ids = logits, capacity, None

    def start(self, ids: np.ndarray) -> np.ndarray:
        self.ids = ids
        return self.logits(ids)[:, -1]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.ids = np.concatenate([self.ids, tokens.reshape(-1, 1).astype(np.int64)], axis=1)
        return self.logits(self.ids)[:, -1]
