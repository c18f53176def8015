import json

import pytest

from dflash_pipeline.data.sources import DataSourceError, is_heldout, load_conversations


def _capture():
    lines = []
    return lines, lines.append


def _turns(*pairs):
    return [{"from": who, "value": text} for who, text in pairs]


@pytest.fixture
def cut_sharegpt(tmp_path):
    """Three complete records (one starting with the assistant, one empty, one good) plus a record cut mid-string."""
    records = [
        {"id": "good_0", "conversations": _turns(("system", "Be brief."), ("human", "Hi?"), ("gpt", "Hello."),
                                                 ("user", "And?"), ("chatgpt", "Bye."), ("human", "trailing"))},
        {"id": "late_1", "conversations": _turns(("gpt", "continuing an earlier part"), ("human", "ok"))},
        {"id": "empty_2", "conversations": []},
    ]
    text = json.dumps(records, indent=2)[:-2]  # drop the closing "\n]"
    cut = '{"id": "cut_3", "conversations": [{"from": "human", "value": "this record never ends \u00e9'
    file = tmp_path / "sharegpt.json"
    file.write_bytes((text + ",\n  " + cut).encode()[:-1])  # the cut falls inside the two-byte character
    return file, len(cut.encode()) - 1


def test_cut_sharegpt_recovers_complete_records_and_filters(cut_sharegpt):
    file, cut_bytes = cut_sharegpt
    lines, log = _capture()
    convs = load_conversations("sharegpt", path=str(file), split="all", log=log)

    assert [c["id"] for c in convs] == ["good_0"]
    assert [m["role"] for m in convs[0]["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert convs[0]["messages"][1] == {"role": "user", "content": "Hi?"}
    loss = [line for line in lines if "cut off" in line]
    assert len(loss) == 1 and "recovered 3 complete records" in loss[0] and f"lost {cut_bytes} bytes" in loss[0]
    summary = lines[-1]
    assert "1 empty" in summary and "1 starting with the assistant" in summary and "read 3" in summary


def test_unknown_role_is_malformed(tmp_path):
    file = tmp_path / "roles.json"
    file.write_text(json.dumps([
        {"id": "a", "conversations": _turns(("bing", "hi"), ("gpt", "yo"))},
        {"id": "b", "conversations": _turns(("human", "hi"), ("bard", "yo"))},
    ]))
    lines, log = _capture()
    convs = load_conversations("sharegpt", path=str(file), split="all", log=log)
    assert [c["id"] for c in convs] == ["b"] and convs[0]["messages"][1]["role"] == "assistant"
    assert "1 with malformed roles" in lines[-1]
    assert not any("cut off" in line for line in lines)  # a closed array reports no loss


def test_embedded_sharegpt_slice_is_quick_and_deterministic():
    lines, log = _capture()
    first = load_conversations("sharegpt", limit=20, log=log)
    assert len(first) == 20
    assert not any("cut off" in line for line in lines)  # stopped long before the end of the file
    assert all(not is_heldout(c["id"], 0.02) for c in first)
    assert all(c["messages"][0]["role"] in ("system", "user") for c in first)
    assert load_conversations("sharegpt", limit=20, log=log) == first


def test_embedded_sharegpt_heldout_partitions_the_same_records():
    log = lambda line: None  # noqa: E731
    everything = load_conversations("sharegpt", split="all", limit=300, log=log)
    in_heldout = [c for c in everything if is_heldout(c["id"], 0.1)]
    in_train = [c for c in everything if not is_heldout(c["id"], 0.1)]
    assert in_heldout and in_train

    heldout = load_conversations("sharegpt", split="heldout", heldout_fraction=0.1, limit=len(in_heldout), log=log)
    train = load_conversations("sharegpt", split="train", heldout_fraction=0.1, limit=len(in_train), log=log)
    assert heldout == in_heldout and train == in_train
    assert not {c["id"] for c in heldout} & {c["id"] for c in train}


def test_skip_and_limit_slice_after_filtering():
    log = lambda line: None  # noqa: E731
    first = load_conversations("sharegpt", limit=10, log=log)
    assert load_conversations("sharegpt", skip=4, limit=6, log=log) == first[4:]


def test_mtbench_has_80_two_turn_prompts():
    convs = load_conversations("mtbench", split="all", log=lambda line: None)
    assert len(convs) == 80
    assert all(len(c["messages"]) == 2 and {m["role"] for m in c["messages"]} == {"user"} for c in convs)
    assert convs[0]["id"].startswith("mtbench-") and len({c["category"] for c in convs}) == 8


def test_humaneval_has_164_tasks():
    convs = load_conversations("humaneval", split="all", log=lambda line: None)
    assert len(convs) == 164
    assert convs[0]["id"] == "HumanEval/0"
    assert "def has_close_elements" in convs[0]["messages"][0]["content"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_file_with_messages_column(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [
        {"id": "x", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"id": "y", "messages": [{"role": "assistant", "content": "starts wrong"}]},
    ])
    convs = load_conversations("file", path=path, split="all", log=lambda line: None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert convs == [{"id": "x", "messages": messages}]


def test_file_with_prompt_column(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "first"}, {"prompt": ""}, {"prompt": "third"}])
    convs = load_conversations("file", path=path, split="all", log=lambda line: None)
    assert convs == [
        {"id": "0", "messages": [{"role": "user", "content": "first"}]},
        {"id": "2", "messages": [{"role": "user", "content": "third"}]},
    ]


def test_file_errors(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [{"text": "hi", "label": 1}])
    with pytest.raises(DataSourceError, match="expected one of messages, conversations, prompt"):
        load_conversations("file", path=path, log=lambda line: None)
    with pytest.raises(DataSourceError, match="not found"):
        load_conversations("file", path=str(tmp_path / "missing.jsonl"), log=lambda line: None)


def test_max_prompt_tokens_filters_long_prompts(tmp_path):
    path = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "one two three"}, {"prompt": "a b c d e f"}])
    calls = []

    def tokenizer(text):
        calls.append(text)
        return {"input_ids": text.split()}

    lines, log = _capture()
    convs = load_conversations("file", path=path, split="all", tokenizer=tokenizer, max_prompt_tokens=3, log=log)
    assert [c["id"] for c in convs] == ["0"]
    assert "1 with prompts over 3 tokens" in lines[-1]

    calls.clear()
    load_conversations("file", path=path, split="all", tokenizer=tokenizer, max_prompt_tokens=3, limit=1, log=log)
    assert calls == ["one two three"]  # stops tokenizing once the limit is reached


def test_min_tokens_keeps_long_conversations_only(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d e"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    path = _jsonl(tmp_path / "chats.jsonl", rows)
    lines, log = _capture()
    convs = load_conversations("file", path=path, split="all", tokenizer=lambda t: {"input_ids": t.split()},
                               min_tokens=5, log=log)
    assert [c["id"] for c in convs] == ["0"]  # 2 + 3 tokens over all its turns; the other has 2
    assert "1 under 5 tokens in all" in lines[-1]
    with pytest.raises(ValueError, match="need a tokenizer"):
        load_conversations("file", path=path, split="all", min_tokens=5)


def test_unknown_source_and_empty_result():
    with pytest.raises(ValueError, match="valid sources: sharegpt, mtbench, humaneval, file, hf"):
        load_conversations("alpaca")
    with pytest.raises(DataSourceError, match="produced no conversations after filtering"):
        load_conversations("humaneval", split="heldout", heldout_fraction=0.0, log=lambda line: None)
