"""Conversation data (data.format: chat): records read from every format, roles checked, bad records
counted and listed; the loss mask on exactly the assistant's tokens; packed sequences computing each
conversation as if alone (the loss of a packed batch equals the unpacked one's)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from llmpipe.chat.synth import family, make_conversations
from llmpipe.chat.template import builtin_template
from llmpipe.data import chat
from llmpipe.data.readers import ChatRecords, ErrorLog, Unit, read_unit
from llmpipe.data.tokenizer import new_tokenizer
from llmpipe.models.llama.model import ModelArgs, Transformer

U = {"role": "user", "content": "What is 17 + 25?"}
A = {"role": "assistant", "content": "42."}
S = {"role": "system", "content": "Be brief."}


def _read(path: Path, fmt: str, field="messages") -> tuple[list[list[dict]], dict]:
    log = ErrorLog()
    docs = list(read_unit(Unit(0, str(path), fmt), ChatRecords(field), 1 << 20, log, max_record_bytes=1 << 20))
    return [chat.from_document(d) for d in docs], log.to_dict()


def test_messages_sharegpt_and_alpaca_records_are_read_and_bad_ones_counted_with_where_and_why(tmp_path):
    lines = [
        {"messages": [S, U, A]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},  # not the field
        {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},  # ShareGPT keys
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5."},
        {"instruction": "Say hi.", "output": "Hi.", "system": "Be nice."},
        {"messages": [U, U, A]},
        {"messages": [A, U]},
        {"messages": [U, A, U]},
        {"messages": [U, {"role": "assistant", "content": 7}]},
        {"messages": [{"role": "tool", "content": "x"}, A]},
        {"messages": []},
        {"text": "plain"},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    convs, log = _read(path, "jsonl")
    assert convs == [
        [S, U, A],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5."}],
        [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Say hi."},
         {"role": "assistant", "content": "Hi."}],
    ]
    assert log["counts"] == {"bad_record": 8}
    reasons = [(e["where"], e["reason"]) for e in log["examples"]]
    assert reasons[0][1] == "field 'messages' is missing (and no Alpaca 'instruction' and 'output')"
    assert reasons[1][1] == ("messages[1]: role 'user' out of order (expected 'assistant': an optional system "
                             "message, then user and assistant alternating)")
    assert reasons[2][1].startswith("messages[0]: role 'assistant' out of order (expected 'user'")
    assert reasons[3][1] == "messages: the conversation ends with 'user', not with the assistant's answer"
    assert reasons[4][1] == "messages[1]: content is a int, not a string"
    assert reasons[5][1] == "messages[0]: role 'tool' is not one of system, user, assistant"
    assert reasons[6][1] == "field 'messages' is empty"
    assert all(w.startswith("byte ") for w, _ in reasons)


def test_parquet_conversations_are_read_from_a_messages_column_or_alpaca_columns(tmp_path):
    msgs = pa.array([[U, A], [U]], type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    pq.write_table(pa.table({"messages": msgs, "id": [1, 2]}), tmp_path / "m.parquet")
    convs, log = _read(tmp_path / "m.parquet", "parquet")
    assert convs == [[U, A]] and log["counts"] == {"bad_record": 1}
    assert log["examples"][0]["where"] == "row 1"
    pq.write_table(pa.table({"instruction": ["Add 1 and 1."], "output": ["2."]}), tmp_path / "a.parquet")
    assert _read(tmp_path / "a.parquet", "parquet")[0] == [[{"role": "user", "content": "Add 1 and 1."},
                                                           {"role": "assistant", "content": "2."}]]
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    convs, log = _read(tmp_path / "t.parquet", "parquet")
    assert convs == [] and log["examples"][0]["reason"] == ("no column 'messages' and no Alpaca 'instruction' "
                                                            "and 'output' (columns: text)")


def test_compressed_jsonl_and_datasets_folders_hold_conversations_too(tmp_path):
    import gzip

    datasets = pytest.importorskip("datasets")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"messages": [U, A]}) + "\n" + json.dumps({"messages": [A]}) + "\n")
    convs, log = _read(tmp_path / "c.jsonl.gz", "jsonl.gz")
    assert convs == [[U, A]] and log["examples"][0]["where"] == "line 2"
    datasets.Dataset.from_dict({"messages": [[S, U, A], [U, U]]}).save_to_disk(str(tmp_path / "ds"))
    convs, log = _read(tmp_path / "ds", "datasets")
    assert convs == [[S, U, A]] and log["counts"] == {"bad_record": 1}
    assert log["examples"][0]["where"].endswith(" row 1")


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Every byte one token, the template's markers special tokens: token boundaries are characters."""
    from tokenizers import AddedToken, models, pre_tokenizers

    tok = new_tokenizer()
    tok.model = models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return tok


def _trained(tok, ids, labels) -> list[str]:
    return [tok.decode([int(i)], skip_special_tokens=False) for i, m in zip(ids, labels) if m]


def test_the_loss_is_on_the_assistants_words_and_end_of_turn_marker_only(byte_tokenizer):
    tpl = builtin_template("chatml")
    messages = [S, U, A, {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "2."}]
    ids, labels, why = chat.encode(byte_tokenizer, tpl, messages, 512, "assistant")
    assert why == ""
    assert _trained(byte_tokenizer, ids, labels) == ["4", "2", ".", "<|im_end|>", "2", ".", "<|im_end|>"]
    text = byte_tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert text == tpl.render(messages)
    first = int(np.flatnonzero(labels)[0])  # right after the generation prompt of the first answer
    assert byte_tokenizer.decode(ids[:first].tolist(), skip_special_tokens=False) == \
        tpl.render(messages[:2], add_generation_prompt=True)
    ids_all, labels_all, _ = chat.encode(byte_tokenizer, tpl, messages, 512, "all")
    assert labels_all.tolist() == [0] + [1] * (len(ids_all) - 1)


def test_a_conversation_whose_answer_is_cut_off_by_seq_len_is_a_bad_record(byte_tokenizer):
    tpl = builtin_template("chatml")
    ids, labels, why = chat.encode(byte_tokenizer, tpl, [U, A], 20, "assistant")
    assert ids is None and why == "no assistant token left after truncation to data.seq_len=20 (40 tokens)"
    ids, labels, _ = chat.encode(byte_tokenizer, tpl, [U, A], 37, "assistant")  # cut inside the answer
    assert _trained(byte_tokenizer, ids, labels) == ["4", "2"]


def test_a_conversation_of_more_messages_than_the_cap_is_a_bad_record(tmp_path):
    pairs = [U, A] * ((chat.MAX_MESSAGES + 2) // 2)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": pairs}) + "\n" + json.dumps({"messages": [U, A]}) + "\n")
    convs, log = _read(path, "jsonl")
    assert convs == [[U, A]] and log["counts"] == {"bad_record": 1}
    assert log["examples"][0]["reason"] == f"field 'messages' holds {len(pairs)} messages, more than 1024"


class _Counted:
    """A template that counts its renders."""

    def __init__(self, tpl):
        self.tpl, self.end_of_turn, self.renders = tpl, tpl.end_of_turn, 0

    def render(self, *args, **kwargs):
        self.renders += 1
        return self.tpl.render(*args, **kwargs)


def test_a_16_mib_conversation_renders_twice_and_tokenizes_only_its_head(byte_tokenizer, monkeypatch):
    """1,024 messages of 16,000 characters: every assistant turn used to render the conversation before it
    (1,025 renders of up to the whole record: 70 hours), and all 16 MiB were tokenized; now the whole renders
    once, the first answer's prefix once (it begins past seq_len: no later turn is rendered), and only the
    head that holds seq_len tokens is tokenized. Here nothing is left to train: a bad record."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i:04d}" + "y" * 15996}
                for i in range(1024)]
    tpl = _Counted(builtin_template("chatml"))
    tokenized = []
    encode = byte_tokenizer.encode
    monkeypatch.setattr(byte_tokenizer, "encode", lambda text, **kw: tokenized.append(len(text)) or encode(text, **kw),
                        raising=False)
    ids, labels, why = chat.encode(byte_tokenizer, tpl, messages, 2048, "assistant")
    assert why.startswith("no assistant token left after truncation to data.seq_len=2048 (more than ")
    assert tpl.renders == 2
    assert len(tokenized) == 1 and tokenized[0] < 1 << 20


def test_turns_past_seq_len_left_unrendered_give_the_labels_every_turn_rendered_gives(byte_tokenizer):
    tpl = builtin_template("chatml")
    messages = [S, U, A, {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "2."}] + \
        [U, A] * 20  # long enough that seq_len 60 tokenizes only the head (encode_head)
    whole = tpl.render(messages)
    enc = byte_tokenizer.encode(whole, add_special_tokens=False)
    for seq_len in (60, 100, 130, 170, 400):
        ids, labels, _ = chat.encode(byte_tokenizer, tpl, messages, seq_len, "assistant")
        assert ids.tolist() == enc.ids[:seq_len]
        spans, _ = chat.assistant_spans(tpl, messages, whole, "", "")  # every turn rendered
        starts = np.asarray([a for a, _ in enc.offsets])
        want = np.zeros(len(enc.ids), np.uint8)
        for a, b in spans:
            want[(starts >= a) & (starts < b)] = 1
        want = want[:seq_len]
        want[:1] = 0
        assert labels.tolist() == want.tolist(), seq_len


def _packed_and_unpacked(seq_len: int):
    rng = np.random.default_rng(0)
    docs = []
    for n in (7, 5, 9, 3):
        ids = rng.integers(1, 50, n)
        lab = (rng.random(n) < 0.6).astype(np.uint8)
        lab[0], lab[-1] = 0, 1
        docs.append((ids, lab))
    ids = np.concatenate([d[0] for d in docs]).astype(np.uint16)
    labs = np.concatenate([d[1] for d in docs])
    return docs, ids, labs


def test_a_packed_batch_has_the_loss_of_the_same_conversations_unpacked(tmp_path):
    """fp32, within 1e-6: the block-causal mask and per-conversation positions make packing invisible."""
    from llmpipe.data.shards import write_shard

    docs, _, _ = _packed_and_unpacked(16)
    write_shard(tmp_path / "train.bin", [d[0] for d in docs], np.uint16)
    with chat.LabelWriter(chat.labels_path(tmp_path / "train.bin")) as w:
        w.add([d[1] for d in docs])
    packed = chat.ChatShard(tmp_path / "train.bin", 16, packing=True)
    padded = chat.ChatShard(tmp_path / "train.bin", 16, packing=False)
    assert packed.groups.tolist() == [0, 2, 4] and packed.num_samples() == 2 and padded.num_samples() == 4
    assert packed.targets.sum() == padded.targets.sum() == sum(int(d[1][1:].sum()) for d in docs)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64,
                                  max_seq_len=32))
    model.init_weights(seed=1)
    x, y, doc = packed.batch(range(2), torch.device("cpu"))
    assert doc[0].tolist() == [0] * 7 + [1] * 5 + [-1] * 4
    loss_packed = F.cross_entropy(model(x, doc_ids=doc).flatten(0, 1), y.flatten(), reduction="sum")
    x1, y1, none = padded.batch(range(4), torch.device("cpu"))
    assert none is None
    loss_alone = F.cross_entropy(model(x1).flatten(0, 1), y1.flatten(), reduction="sum")
    n = int((y != -100).sum())
    assert n == int((y1 != -100).sum()) == int(packed.targets.sum())
    torch.testing.assert_close(loss_packed / n, loss_alone / n, atol=1e-6, rtol=0)
    # and the logits of each conversation are its logits alone
    torch.testing.assert_close(model(x, doc_ids=doc)[0, 7:12], model(x1)[1, :5], atol=1e-5, rtol=0)


def test_the_conversation_set_is_deterministic_and_splits_by_question():
    train, val = make_conversations(seed=3, n_arithmetic=200, val_fraction=0.2)
    assert (train, val) == make_conversations(seed=3, n_arithmetic=200, val_fraction=0.2)
    questions = {r["messages"][-2]["content"] for r in train}
    assert not questions & {r["messages"][-2]["content"] for r in val}
    assert len(train) + len(val) == 200 + 200 + 200 + 24 and 90 <= len(val) <= 160
    for r in train + val:
        assert chat.check_messages(r["messages"])[1] == ""
    families = Counter(family(r) for r in train + val)
    assert families == {"arithmetic": 200, "words": 200, "classify": 200, "facts": 24}
    for r in train + val:  # every answer is right
        q, a = r["messages"][-2]["content"], r["messages"][-1]["content"]
        if family(r) == "arithmetic":
            x, op, y = re.search(r"(\d+) ([-+*]) (\d+)", q).groups()
            assert a == f"{eval(f'{int(x)} {op} {int(y)}')}.", q  # noqa: S307 (two ints and an operator)
        elif family(r) == "classify":
            shown = q.split("\n")[-1] if "\n" in q else q.split()[1]
            assert a == (("Even." if int(shown) % 2 == 0 else "Odd.") if "odd" in q
                         else "A number." if shown.isdigit() else "A word."), q
        elif family(r) == "words":
            words = q.split("\n")[1:]
            want = words[-1] if "last" in q else words[0]
            assert a == f"{want}.", q
    # a held-out word is never an answer in training
    answers = {r["messages"][-1]["content"] for r in train}
    assert not {r["messages"][-1]["content"] for r in val if family(r) == "words"} & answers
