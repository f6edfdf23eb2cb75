"""Conversations (data.format: chat): records -> validated messages -> token ids with a loss mask -> samples.

A record holds a `messages` list of {role, content} (OpenAI style; ShareGPT's {from, value} is mapped:
human -> user, gpt -> assistant) under data.messages_field, or is an Alpaca record (instruction, input,
output -> a user message, instruction and input joined by a blank line, and the assistant's output; an
optional `system` field becomes the system message). Roles: an optional system message first, then user
and assistant alternating, from user to assistant. Anything else is a bad record, counted and listed.

The readers hand a conversation on as its canonical JSON (`json.dumps` of the messages), so dedup, the
split and the work units treat it as any document. `encode` renders it with the chat template and marks
which tokens are trained: the assistant's spans, found by rendering prefixes (messages[:i] with the
generation prompt vs messages[:i+1]), from the assistant's first character through its end-of-turn marker
(so the model learns to stop), mapped to tokens by their character offsets (a token counts when it starts
inside a span); turns that begin after the data.seq_len tokens kept are not rendered, and a record of more
than MAX_MESSAGES messages is a bad record. `data.train_on: all` trains every token instead.

Shards: `<split>.bin/.idx` hold one conversation per document (at most seq_len tokens, no EOS between:
the boundaries are in the .idx), `<split>.labels` one byte per token, 1 where that token is a target.
`ChatShard` makes training samples of them: packed (several conversations per sequence, in shard order,
each with its own document id, so the model's block-causal mask and per-document positions keep them
apart) or one conversation per sequence, padded; targets outside a conversation or not trained are -100.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.data.errors import DataError
from llmpipe.data.shards import TokenShard

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IGNORE = -100  # a target F.cross_entropy leaves out
LABELS_SUFFIX = ".labels"  # train.labels beside train.bin: one uint8 per token
_SURROGATE = re.compile("[\ud800-\udfff]")
# NOTE: a bad record beyond this: real multi-turn data has tens of messages, and each assistant turn costs a
# render of the conversation before it (bounded by data.seq_len in encode, but a record at the 16 MiB limit
# can hold a million one-character messages)
MAX_MESSAGES = 1024
_MARKER = re.compile(r"<\|[A-Za-z0-9_]{1,64}\|>")  # special-token-like markers in a template (<|im_end|>)


# --------------------------------------------------------------------------- records


def _message(m: Any, where: str) -> tuple[dict | None, str]:
    if not isinstance(m, dict):
        return None, f"{where} is a {type(m).__name__}, not an object"
    if "role" in m:
        role, content = m.get("role"), m.get("content")
    elif "from" in m:  # ShareGPT
        role, content = SHAREGPT_ROLES.get(m.get("from"), m.get("from")), m.get("value")
    else:
        return None, f"{where} has no 'role'"
    if role not in ROLES:
        return None, f"{where}: role {role!r} is not one of {', '.join(ROLES)}"
    if not isinstance(content, str):
        return None, f"{where}: content is {'missing' if content is None else f'a {type(content).__name__}'}, " \
                     "not a string"
    if not content.isascii() and (s := _SURROGATE.search(content)):
        return None, f"{where}: content does not encode as UTF-8 (a lone surrogate U+{ord(s.group()):04X})"
    return {"role": role, "content": content}, ""


def check_messages(messages: Any, field: str = "messages") -> tuple[list[dict] | None, str]:
    """(the messages as [{role, content}], "") or (None, why not): roles in order, contents strings."""
    if not isinstance(messages, list):
        return None, f"field {field!r} is {'null' if messages is None else f'a {type(messages).__name__}'}, " \
                     "not a list"
    if not messages:
        return None, f"field {field!r} is empty"
    if len(messages) > MAX_MESSAGES:
        return None, f"field {field!r} holds {len(messages)} messages, more than {MAX_MESSAGES}"
    out = []
    for i, m in enumerate(messages):
        msg, why = _message(m, f"{field}[{i}]")
        if msg is None:
            return None, why
        out.append(msg)
    first = 1 if out[0]["role"] == "system" else 0
    for i, msg in enumerate(out[first:], start=first):
        expected = "user" if (i - first) % 2 == 0 else "assistant"
        if msg["role"] != expected:
            return None, f"{field}[{i}]: role {msg['role']!r} out of order (expected {expected!r}: an optional " \
                         "system message, then user and assistant alternating)"
    if out[-1]["role"] != "assistant":
        return None, f"{field}: the conversation ends with {out[-1]['role']!r}, not with the assistant's answer"
    return out, ""


def _alpaca(record: dict) -> tuple[list[dict] | None, str]:
    parts = {}
    for key in ("instruction", "input", "output", "system"):
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            return None, f"Alpaca field {key!r} is a {type(value).__name__}, not a string"
        parts[key] = value or ""
    user = parts["instruction"] + (f"\n\n{parts['input']}" if parts["input"].strip() else "")
    messages = ([{"role": "system", "content": parts["system"]}] if parts["system"] else []) + \
        [{"role": "user", "content": user}, {"role": "assistant", "content": parts["output"]}]
    return check_messages(messages, "instruction/input/output")


def conversation(record: Any, messages_field: str) -> tuple[list[dict] | None, str]:
    """A record's messages: its `messages_field` list, or an Alpaca record's; (None, why) otherwise."""
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    if messages_field in record:
        return check_messages(record[messages_field], messages_field)
    if "instruction" in record and "output" in record:
        return _alpaca(record)
    return None, f"field {messages_field!r} is missing (and no Alpaca 'instruction' and 'output')"


def to_document(messages: list[dict]) -> str:
    """The canonical text of a conversation that the readers pass on (and dedup hashes)."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def from_document(text: str) -> list[dict]:
    return json.loads(text)


def content_text(messages: list[dict]) -> str:
    """What data.filters judge of a conversation: its messages' contents, one per line."""
    return "\n".join(m["content"] for m in messages)


# --------------------------------------------------------------------------- tokens and loss mask


def special_markers(template_source: str) -> list[str]:
    """The <|...|> markers a template writes (chatml's <|im_start|>, <|im_end|>), in order of appearance:
    a tokenizer trained for a chat run has each as one special token."""
    return list(dict.fromkeys(_MARKER.findall(template_source)))


def assistant_spans(tpl, messages: list[dict], text: str, bos: str, eos: str,
                    limit: int | None = None) -> tuple[list[tuple[int, int]], str]:
    """Character spans [a, b) of `text` (the whole conversation rendered) that the assistant says: its
    words and its end-of-turn marker; ([], why) when the template does not render prefixes as prefixes.
    `limit`: the character where the kept tokens end; turns that begin past it are not rendered (each turn
    renders the conversation before it, so a long conversation would cost renders quadratic in its length)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tpl.render(messages[:i], add_generation_prompt=True, bos_token=bos, eos_token=eos)
        if limit is not None and len(before) >= limit and text.startswith(before):
            break  # this turn and every later one begin after the last kept token
        upto = tpl.render(messages[:i + 1], bos_token=bos, eos_token=eos)
        if not (upto.startswith(before) and text.startswith(upto)):
            return [], f"the chat template does not render message {i}'s conversation as a prefix of the whole " \
                       "(cannot tell the assistant's tokens)"
        a, turn = len(before), upto[len(before):]
        end = next((turn.rfind(e) + len(e) for e in tpl.end_of_turn if e in turn), len(turn.rstrip()))
        spans.append((a, a + end))
    return spans, ""


_FACTS: dict[int, tuple[object, int, tuple[tuple[str, bool], ...]]] = {}


def _tokenizer_facts(tok) -> tuple[int, tuple[str, ...]]:
    """(the longest token's string length, the added tokens the tokenizer splits text at before anything
    else: special ones only while it encodes them as such), the vocabulary read once per tokenizer."""
    if id(tok) not in _FACTS or _FACTS[id(tok)][0] is not tok:
        longest = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)
        added = tuple((t.content, t.special) for t in tok.get_added_tokens_decoder().values()
                      if t.content and not (t.normalized or t.lstrip or t.rstrip or t.single_word))
        _FACTS[id(tok)] = (tok, longest, added)
    _, longest, added = _FACTS[id(tok)]
    plain = getattr(tok, "encode_special_tokens", False)  # special tokens then read as text: no split there
    return longest, tuple(content for content, special in added if not (special and plain))


def encode_head(tok, text: str, seq_len: int):
    """(the encoding of `text`'s head, whether it was cut): exactly the whole text's first `seq_len` tokens
    and their offsets, without tokenizing megabytes that truncation drops. A token spans at most the
    longest token string's characters (twice that, for a normalizer that composes characters), so the first
    seq_len tokens lie in `need` characters; the text is cut at the first added token after that, where the
    tokenizer splits the text before anything else, so the tokens before the cut are the whole text's."""
    longest, markers = _tokenizer_facts(tok)
    need = seq_len * longest * 2
    cut = min((p for p in (text.find(m, need) for m in markers) if p >= 0), default=None) \
        if len(text) > need else None
    return tok.encode(text if cut is None else text[:cut], add_special_tokens=False), cut is not None


def encode(tok, tpl, messages: list[dict], seq_len: int, train_on: str, bos: str = "",
           eos: str = "") -> tuple[np.ndarray | None, np.ndarray | None, str]:
    """(token ids uint32, labels uint8: 1 = a trained target, "") of one conversation, cut to `seq_len`
    tokens; (None, None, why) when nothing is left to train."""
    text = tpl.render(messages, bos_token=bos, eos_token=eos)
    enc, cut = encode_head(tok, text, seq_len)
    ids = np.asarray(enc.ids, dtype=np.uint32)
    if train_on == "all":
        labels = np.ones(len(ids), dtype=np.uint8)
    else:
        limit = enc.offsets[seq_len][0] if len(enc.offsets) > seq_len else None
        spans, why = assistant_spans(tpl, messages, text, bos, eos, limit)
        if why:
            return None, None, why
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        labels = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            labels[(starts >= a) & (starts < b)] = 1
    ids, labels = ids[:seq_len], labels[:seq_len]
    labels[:1] = 0  # the first token is never a target: nothing comes before it
    if not labels.any():
        what = "assistant token" if train_on == "assistant" else "token to predict"
        count = f"more than {len(enc.ids)}" if cut else f"{len(enc.ids)}"
        return None, None, f"no {what} left after truncation to data.seq_len={seq_len} ({count} tokens)"
    return ids, labels, ""


# --------------------------------------------------------------------------- label files


class LabelWriter:
    """`<name>.labels` beside a token shard: one uint8 per token, appended document by document."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")  # closed in close() / __exit__
        self.n = 0

    def add(self, labels: list[np.ndarray]) -> None:
        for lab in labels:
            self._file.write(np.asarray(lab, dtype=np.uint8).tobytes())
            self.n += len(lab)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LabelWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def labels_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(LABELS_SUFFIX)


def read_labels(bin_path: str | Path, n_tokens: int) -> np.ndarray:
    path = labels_path(bin_path)
    size = path.stat().st_size if path.is_file() else None
    if size != n_tokens:
        found = "missing" if size is None else f"{size} bytes"
        raise DataError(f"{path}: {found}, but its token shard holds {n_tokens} tokens (one label byte each)")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, np.uint8)


# --------------------------------------------------------------------------- samples


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """First document of each packed sequence (plus the end), documents kept in order: a sequence takes
    documents while their lengths fit in seq_len. (n_sequences + 1,) int64."""
    starts, used = [0], 0
    for j, n in enumerate(lengths.tolist()):
        if used + n > seq_len and used:
            starts.append(j)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


class ChatShard:
    """Conversation samples of one split: packed (`packing`) or one conversation per sequence, padded."""

    def __init__(self, bin_path: str | Path, seq_len: int, packing: bool, pad_id: int = 0):
        self.tokens = TokenShard(bin_path)
        self.bin_path = self.tokens.bin_path
        self.labels = read_labels(bin_path, self.tokens.n_tokens)
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        n = self.tokens.n_docs
        self.bounds = np.append(np.asarray(self.tokens.doc_offsets, dtype=np.int64), self.tokens.n_tokens)
        lengths = np.diff(self.bounds)
        if n and lengths.max() > seq_len:
            raise DataError(f"{self.bin_path}: a conversation of {int(lengths.max())} tokens is longer than "
                            f"data.seq_len={seq_len}; prepare_data cuts them to the seq_len it ran with")
        self.groups = pack(lengths, seq_len) if packing else np.arange(n + 1, dtype=np.int64)
        # each sample's targets (a label on every token but its conversation's first), for the loss's mean
        per_doc = np.add.reduceat(self.labels, self.bounds[:-1]).astype(np.int64) if n else np.zeros(0, np.int64)
        per_doc -= self.labels[self.bounds[:-1]] if n else 0
        cum = np.concatenate([[0], np.cumsum(per_doc)])
        self.targets = cum[self.groups[1:]] - cum[self.groups[:-1]]

    def num_samples(self, seq_len: int | None = None) -> int:
        return len(self.groups) - 1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, document ids), each (seq_len,) int64; padding has document id -1 and target -100."""
        T = self.seq_len
        x = np.full(T, self.pad_id, dtype=np.int64)
        y = np.full(T, IGNORE, dtype=np.int64)
        doc = np.full(T, -1, dtype=np.int64)
        p = 0
        for d in range(int(self.groups[i]), int(self.groups[i + 1])):
            a, b = int(self.bounds[d]), int(self.bounds[d + 1])
            ids = np.asarray(self.tokens.tokens[a:b], dtype=np.int64)
            lab = np.asarray(self.labels[a:b], dtype=bool)
            n = b - a
            x[p:p + n] = ids
            y[p:p + n - 1] = np.where(lab[1:], ids[1:], IGNORE)
            doc[p:p + n] = d
            p += n
        return x, y, doc

    def batch(self, indices, device) -> tuple[Any, Any, Any]:
        """(x, y, doc_ids) tensors (B, T) on `device`; doc_ids None when not packed (a causal mask suffices:
        the padding comes after the conversation)."""
        import torch

        rows = [self.sample(int(i)) for i in indices]
        x, y, doc = (torch.from_numpy(np.stack(r)).to(device) for r in zip(*rows))
        return x, y, doc if self.packing else None
