"""Ray Data ingest: JSONL, Parquet and JSON-array (ShareGPT dump) files stream through
tokenisation to the same rows the in-memory path (and the driver's, for small data) makes;
held-out conversations are split off deterministically and never trained on; trainers get
disjoint shards; the driver's counting pass equals the in-memory counts."""

import json
import threading

import pytest
import ray
import torch
from transformers import AutoTokenizer

from eagle_ray.data.chat import conversation_key
from eagle_ray.data.draft_vocab import answer_token_counts, count_answers
from eagle_ray.data.ingest import (
    TokenizeChats,
    held_out,
    read_chats,
    tokenized,
    tokenized_in_driver,
    training_rows,
)
from eagle_ray.data.tokenize import tokenize_chats
from eagle_ray.tiny import generate_chat_samples

from pool_helpers import running_ray

pytestmark = pytest.mark.slow

SAMPLES = generate_chat_samples(40, seed=11)
MAX_LENGTH = 32  # small, so that some rows are truncated


@pytest.fixture(scope="module")
def local_ray():
    with running_ray():
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory, local_ray):
    root = tmp_path_factory.mktemp("chats")
    with open(root / "chats.jsonl", "w") as f:
        for sample in SAMPLES:
            f.write(json.dumps(sample) + "\n")
    ray.data.from_items(SAMPLES).write_parquet(str(root / "parquet"))
    # A ShareGPT dump: one JSON array of `conversations`, as most are published.
    (root / "sharegpt.json").write_text(json.dumps([as_sharegpt(s) for s in SAMPLES], indent=1))
    return {"jsonl": str(root / "chats.jsonl"), "parquet": str(root / "parquet"),
            "sharegpt_json_array": str(root / "sharegpt.json")}


def as_sharegpt(sample: dict) -> dict:
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"id": conversation_key(sample["messages"]),
            "conversations": [{"from": speakers[m["role"]], "value": m["content"]}
                              for m in sample["messages"]]}


def rows_of(dataset) -> list[tuple[list[int], list[int]]]:
    return [(list(r["input_ids"]), list(r["loss_mask"])) for r in dataset.iter_rows()]


@pytest.mark.parametrize("shape", ["jsonl", "parquet", "sharegpt_json_array"])
def test_files_give_the_rows_of_the_in_memory_path(files, llama_path, shape):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    vocab = len(tokenizer)
    streamed = tokenized(read_chats(files[shape], 0, 0.25), str(llama_path), MAX_LENGTH, vocab,
                         "truncate", 0.25).materialize()  # one execution for the comparisons
    in_memory = tokenize_chats([(str(i), s["messages"]) for i, s in enumerate(SAMPLES)],
                               tokenizer, MAX_LENGTH, vocab)
    assert in_memory.counts()["truncated"] > 0, "the test covers truncation"
    assert sorted(rows_of(training_rows(streamed, set()))) == sorted(in_memory.rows)
    # Small data tokenised in the driver (`data.tokenize_in_driver_mb`): the same rows, columns
    # and statuses as the Ray Data stage makes.
    in_driver = tokenized_in_driver(read_chats(files[shape], 0, 0.25),
                                    TokenizeChats(str(llama_path), MAX_LENGTH, vocab, "truncate"))
    assert in_driver.schema().names == streamed.schema().names
    assert sorted((r["key"], r["status"], r["length"], list(r["input_ids"]))
                  for r in in_driver.iter_rows()) == \
        sorted((r["key"], r["status"], r["length"], list(r["input_ids"]))
               for r in streamed.iter_rows())
    assert sorted(rows_of(training_rows(in_driver, set()))) == sorted(in_memory.rows)


def test_held_out_conversations_are_the_first_and_never_trained_on(files, llama_path):
    dataset = read_chats(files["jsonl"], 0, 0.25)
    held = held_out(dataset, 5)
    assert held == [s["messages"] for s in SAMPLES[:5]]
    keys = {conversation_key(m) for m in held}
    rows = tokenized(dataset, str(llama_path), MAX_LENGTH, 10**6, "truncate", 0.25)
    trained = list(training_rows(rows, keys).iter_rows())
    assert not {r["key"] for r in trained} & keys
    duplicates_of_held = sum(conversation_key(s["messages"]) in keys for s in SAMPLES[5:])
    assert len(trained) == len(SAMPLES) - 5 - duplicates_of_held


def test_the_counting_pass_equals_the_in_memory_counts(files, llama_path):
    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    vocab = len(tokenizer)
    rows = tokenized(read_chats(files["jsonl"], 0, 0.25), str(llama_path), MAX_LENGTH, vocab,
                     "truncate", 0.25)
    counts, statuses, tokens, _ = count_answers(rows, set(), vocab)
    in_memory = tokenize_chats([(str(i), s["messages"]) for i, s in enumerate(SAMPLES)],
                               tokenizer, MAX_LENGTH, vocab)
    assert torch.equal(torch.from_numpy(counts), answer_token_counts(in_memory.rows, vocab))
    assert {k: statuses[k] for k in in_memory.counts()} == in_memory.counts()
    assert tokens == sum(len(ids) for ids, _ in in_memory.rows)


def test_trainers_get_disjoint_shards_covering_every_row(files, llama_path):
    rows = tokenized(read_chats(files["jsonl"], 0, 0.25), str(llama_path), MAX_LENGTH, 10**6,
                     "truncate", 0.25)
    everything = training_rows(rows, set())
    expected = sorted(r["key"] for r in everything.iter_rows())
    shards = everything.streaming_split(2, equal=True)  # what Ray Train hands its workers
    seen: list[list[str]] = [[], []]

    def read(i):
        seen[i] = [key for batch in shards[i].iter_batches(batch_size=8, batch_format="numpy")
                   for key in batch["key"]]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(seen[0]) == len(seen[1]) == len(expected) // 2, "equal shares"
    remaining = list(expected)
    for key in seen[0] + seen[1]:
        remaining.remove(key)  # raises if a row came twice or from nowhere: disjoint
    assert len(remaining) == len(expected) % 2, "only the odd row out is left"
