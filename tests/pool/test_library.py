"""The pool as a library (docs/library.md): the public names, the window sized against a pool,
the draft's identity check, the Ray Data stage's rows and its exactly-once writer; and (slow)
both examples, run as scripts against one tiny-target vLLM pool, deliver exactly the
supervision the same engine gives in-process, while a pool serving other aux layer ids is
refused by the identity check (the control)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eagle_ray
from eagle_ray import (
    ClientConfig,
    ConfigError,
    Eagle3TargetBatch,
    PoolConfig,
    SupervisionRows,
    TargetIdentity,
    expect_target,
    supervision_bytes_per_token,
    window_config,
    write_supervision_rows,
)
from eagle_ray.pool.data_stage import pack_rows, rows_of, supervise_rows
from eagle_ray.testing import fixed_latency_target

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "eagle_ray_test"
SERVED = TargetIdentity(model_path="/models/tiny", fingerprint="f" * 32, num_hidden_layers=8,
                        hidden_size=128, vocab_size=1024, aux_layer_ids=(1, 3, 4),
                        encoding="last_hidden", dtype="float32", max_length=4096)


def load_example(name: str):
    """An example script as a module (its functions; nothing runs on import)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the public API


def test_the_public_names_come_from_one_place_and_import_lazily():
    assert set(eagle_ray.__all__) == set(eagle_ray._EXPORTS)
    for name in eagle_ray.__all__:
        module = importlib.import_module(eagle_ray._EXPORTS[name])
        assert getattr(eagle_ray, name) is getattr(module, name), name
    code = ("import sys, eagle_ray\n"
            "print(sorted(m for m in ('ray', 'torch', 'vllm') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    with pytest.raises(AttributeError):
        eagle_ray.PoolRouter  # noqa: B018 -- private names are not exported


# ---------------------------------------------------------------- the window


def test_the_window_keeps_two_engine_calls_per_replica_within_the_routers_cap():
    sized = window_config(2048, replicas=1, max_tokens_per_engine_call=16384,
                          max_outstanding_tokens_per_replica=16384, bytes_per_token=100)
    # feed: 2 x 16384 = 32768 tokens, but the router holds 16384 per replica: 8 micro-batches
    assert (sized.max_inflight_micro_batches, sized.max_inflight_tokens) == (8, 16384)
    shared = window_config(2048, replicas=2, max_tokens_per_engine_call=16384,
                           max_outstanding_tokens_per_replica=16384, bytes_per_token=100,
                           clients=4)
    assert shared.max_inflight_micro_batches == 4  # 2 x 16384 / 4 clients
    fed = window_config(1024, replicas=4, max_tokens_per_engine_call=2048,
                        max_outstanding_tokens_per_replica=65536, bytes_per_token=100)
    assert fed.max_inflight_micro_batches == 16  # 2 calls x 2048 x 4 replicas / 1024


def test_the_window_fits_a_memory_budget_and_keeps_the_other_settings():
    base = ClientConfig(timeout_s=30.0, max_attempts=2)
    sized = window_config(2048, replicas=1, max_tokens_per_engine_call=16384,
                          max_outstanding_tokens_per_replica=16384, bytes_per_token=1000,
                          memory_budget_bytes=5 * 2048 * 1000, base=base)
    assert sized.max_inflight_micro_batches == 5
    assert (sized.timeout_s, sized.max_attempts) == (30.0, 2)
    with pytest.raises(ValueError, match="over memory_budget_bytes"):
        window_config(2048, replicas=1, max_tokens_per_engine_call=16384,
                      max_outstanding_tokens_per_replica=16384, bytes_per_token=1000,
                      memory_budget_bytes=2047 * 1000)
    with pytest.raises(ValueError, match="replicas=0"):
        window_config(2048, replicas=0, max_tokens_per_engine_call=16384,
                      max_outstanding_tokens_per_replica=16384, bytes_per_token=1000)


def test_supervision_bytes_per_token_follow_the_encoding_and_dtype():
    assert supervision_bytes_per_token(SERVED) == (3 * 128 + 128) * 4 + 24
    logits = TargetIdentity(**{**SERVED.to_dict(), "encoding": "logits", "dtype": "bfloat16"})
    assert supervision_bytes_per_token(logits) == (3 * 128 + 1024) * 2 + 24


# ---------------------------------------------------------------- the draft's identity check


def test_the_identity_check_accepts_what_the_draft_expects():
    expect_target(SERVED)
    expect_target(SERVED, fingerprint="f" * 32, aux_layer_ids=[1, 3, 4], hidden_size=128,
                  vocab_size=1024, dtype="float32")


@pytest.mark.parametrize(("expected", "message"), [
    ({"aux_layer_ids": [0, 2, 5]}, r"aux_layer_ids \[0, 2, 5\] \(the pool serves \[1, 3, 4\]\)"),
    ({"fingerprint": "0" * 32}, "fingerprint 0+ "),
    ({"hidden_size": 4096, "vocab_size": 1024}, r"hidden_size 4096 \(the pool serves 128\)\."),
])
def test_the_identity_check_refuses_another_target(expected, message):
    with pytest.raises(ConfigError, match=message):
        expect_target(SERVED, **expected)


# ---------------------------------------------------------------- the stage and the writer


class InProcessClient:
    """`PoolClient.stream` over a backend in this process (the stage's rows without Ray)."""

    def __init__(self, backend) -> None:
        self.backend, self.calls = backend, []

    def stream(self, micro_batches):
        for micro_batch in micro_batches:
            self.calls.append(micro_batch)
            yield self.backend.generate_batch(*micro_batch)


@pytest.fixture(scope="module")
def synthetic():
    return fixed_latency_target(PoolConfig(backend="eagle_ray.testing:fixed_latency_target"))


def token_rows(keys, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 1024, (n,), generator=generator).numpy() for n in lengths]
    masks = [(np.arange(n) >= n // 2).astype(np.int64) for n in lengths]
    column = np.empty(len(ids), dtype=object)
    column[:] = ids
    mask_column = np.empty(len(masks), dtype=object)
    mask_column[:] = masks
    return {"key": np.array(keys), "input_ids": column, "loss_mask": mask_column}


def alone(backend, ids, mask) -> Eagle3TargetBatch:
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]
    return backend.generate_batch(ids, torch.ones_like(ids),
                                  torch.as_tensor(np.asarray(mask, dtype=np.int64))[None])


def test_rows_are_packed_in_order_within_the_token_and_row_budgets():
    assert pack_rows([5, 5, 5, 20, 3, 3], max_tokens=16, max_rows=3) == [[0, 1, 2], [3], [4, 5]]
    assert pack_rows([5, 5, 5, 5], max_tokens=100, max_rows=2) == [[0, 1], [2, 3]]
    assert pack_rows([], max_tokens=8, max_rows=2) == []


def test_each_output_row_is_its_row_alone_and_written_once_per_key(synthetic, tmp_path):
    lengths = [7, 12, 3, 30, 9]
    batch = token_rows(["a", "b", "c", "d/e", "a"], lengths)  # "a" twice; "d/e" unsafe name
    client = InProcessClient(synthetic)
    out = list(supervise_rows(client, batch, max_tokens=40, max_rows=3))
    assert len(client.calls) == 3 and sum(len(c["key"]) for c in out) == 5
    identity = TargetIdentity.of_backend(synthetic, None).to_dict()
    written = [write_supervision_rows(rows, str(tmp_path), identity) for rows in out]
    assert [list(w["written"]) for w in written] == [[True, True, True], [True], [False]]
    stored = SupervisionRows(tmp_path)
    assert sorted(stored.keys()) == ["a", "b", "c", "d/e"] and len(stored) == 4
    for i, key in enumerate(["a", "b", "c", "d/e"]):
        expected = alone(synthetic, batch["input_ids"][i], batch["loss_mask"][i])
        got = stored.read(key)
        assert set(got.tensors()) == set(expected.tensors())
        for name, tensor in expected.tensors().items():
            assert torch.equal(got.tensors()[name], tensor), (key, name)
    # A re-executed block: the same rows again write nothing and change no file.
    files = {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")}
    again = [write_supervision_rows(rows, str(tmp_path), identity)
             for rows in supervise_rows(InProcessClient(synthetic), batch, 40, 3)]
    assert not any(w["written"].any() for w in again)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")} == files
    other = {**identity, "aux_layer_ids": [0, 2, 5]}
    with pytest.raises(ConfigError, match="write to another folder"):
        write_supervision_rows(out[0], str(tmp_path), other)


def test_bf16_rows_keep_their_bits(synthetic, tmp_path):
    ids, attention, loss = (torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]]),
                            torch.tensor([[0, 1, 1, 0]]))
    batch = synthetic.generate_batch(ids, attention, loss)
    bf16 = Eagle3TargetBatch(**{n: t.to(torch.bfloat16) if t.is_floating_point() else t
                                for n, t in batch.tensors().items()})
    rows = rows_of(bf16, ["k"], [3])
    assert rows["aux_hidden_states"].dtype == np.int16 and rows["hidden_dtype"][0] == "bfloat16"
    identity = {**TargetIdentity.of_backend(synthetic, None).to_dict(), "dtype": "bfloat16"}
    write_supervision_rows(rows, str(tmp_path), identity)
    back = SupervisionRows(tmp_path).read("k")
    assert back.aux_hidden_states.dtype == torch.bfloat16
    assert torch.equal(back.aux_hidden_states, bf16.aux_hidden_states[:, :3])
    assert torch.equal(back.last_hidden, bf16.last_hidden[:, :3])


# ---------------------------------------------------------------- the examples (slow)


@pytest.fixture(scope="module")
def example_pool(llama_path):
    """The pool the examples share, started by the examples' own `connect_or_start` (no pool
    runs yet: the tiny target on vLLM, the examples' default), and the same engine built
    in-process from the pool's config (the reference)."""
    import ray

    from eagle_ray.backends import build_backend

    ray.init(num_cpus=4, object_store_memory=400 * 2**20, include_dashboard=False)
    try:
        pool, started = load_example("own_train_loop").connect_or_start("library", NAMESPACE)
        assert started, "no pool ran before"
        served = pool.identity()
        reference = build_backend(pool.config)
        try:
            yield pool, served, reference, ray.get_runtime_context().gcs_address
        finally:
            reference.shutdown()
            pool.shutdown()
    finally:
        ray.shutdown()


def run_example(name: str, address: str, *args: str) -> subprocess.CompletedProcess:
    """`python examples/<name>.py --address ... args`, a driver of the test's Ray cluster."""
    command = [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--address", address,
               "--pool-name", "library", "--namespace", NAMESPACE, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def expected_target(served) -> list[str]:
    from eagle_ray import checkpoint_fingerprint

    return ["--expect-aux-layer-ids", *map(str, served.aux_layer_ids),
            "--expect-fingerprint", checkpoint_fingerprint(served.model_path)]


def assert_same_supervision(got: dict[str, torch.Tensor], expected: Eagle3TargetBatch, what):
    assert set(got) == set(expected.tensors()), what
    for name, tensor in expected.tensors().items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (what, name)


@pytest.mark.slow
def test_own_train_loop_trains_on_the_pools_supervision_and_checkpoints(example_pool, tmp_path):
    from safetensors.torch import load_file

    pool, served, reference, address = example_pool
    steps = 3
    result = run_example("own_train_loop", address, "--steps", str(steps), "--workers", "2",
                         "--output", str(tmp_path / "train"),
                         "--save-supervision", str(tmp_path / "seen"), *expected_target(served))
    assert result.returncode == 0, result.stderr[-6000:]
    assert "trained 3 steps" in result.stderr
    checkpoints = sorted((tmp_path / "train" / "own_train_loop").glob("checkpoint_*/draft.pt"))
    assert checkpoints, "ray.train.report(checkpoint=...) kept no checkpoint"
    assert torch.load(checkpoints[-1])["step"] == steps
    # Rank 0 streamed the example's micro-batches of seed 0: each equals the engine in-process.
    toy = load_example("own_train_loop").toy_micro_batches(served.vocab_size, steps, seed=0)
    for step, inputs in enumerate(toy, start=1):
        seen = load_file(tmp_path / "seen" / f"step-{step}.safetensors")
        assert_same_supervision(seen, reference.generate_batch(*inputs), f"step {step}")
    assert pool.status()["replicas"]["library-replica-0"]["restarts"] == 0


@pytest.mark.slow
def test_ray_data_stage_writes_the_pools_supervision_once_per_key(example_pool, tmp_path):
    pool, served, reference, address = example_pool
    output = tmp_path / "rows"
    # The kit's chats with four of them repeated, as real datasets repeat conversations.
    lines = eagle_ray.tiny_chat_dataset(24).read_text().splitlines()
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(f"{line}\n" for line in lines + lines[3:7]))
    args = ("--data", str(data), "--concurrency", "2", "--output", str(output),
            *expected_target(served))
    first = run_example("ray_data_supervision", address, *args)
    assert first.returncode == 0, first.stderr[-6000:]
    # The same rows, tokenised by the example's own stage, then run through the engine here.
    example = load_example("ray_data_supervision")
    conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    column = np.empty(len(conversations), dtype=object)
    column[:] = conversations
    tokens = example.Tokenize(served.model_path, served.max_length)({"messages": column})
    keys = list(dict.fromkeys(tokens["key"]))  # repeated conversations share their key
    assert len(keys) == len(conversations) - 4, "repeated conversations share their key"
    stored = SupervisionRows(output)
    assert stored.identity == served and sorted(stored.keys()) == sorted(keys)
    for key, ids, mask in zip(tokens["key"], tokens["input_ids"], tokens["loss_mask"],
                              strict=True):
        assert_same_supervision(stored.read(key).tensors(), alone(reference, ids, mask), key)
    # Run again (every block executed a second time): nothing is written twice.
    files = {p.name: p.stat().st_mtime_ns for p in output.glob("*.safetensors")}
    second = run_example("ray_data_supervision", address, *args)
    assert second.returncode == 0, second.stderr[-6000:]
    assert f"{len(conversations)} rows: 0 keys written now" in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in output.glob("*.safetensors")} == files


@pytest.mark.slow
def test_a_pool_serving_other_aux_layer_ids_is_refused_by_both_examples(
        example_pool, tmp_path, caplog):
    """The control: the same expectations, against a pool of the same checkpoint serving
    other aux layer ids, stop both examples before they train or write anything."""
    from eagle_ray import TargetPool

    _, served, _, _ = example_pool
    other = TargetPool.create(PoolConfig(backend="hf", aux_layer_ids=[0, 2, 5], name="other-ids",
                                         namespace=NAMESPACE))
    try:
        assert other.identity().fingerprint == served.fingerprint  # only the ids differ
        for name, output in [("own_train_loop", tmp_path / "train"),
                             ("ray_data_supervision", tmp_path / "rows")]:
            caplog.clear()
            code = load_example(name).main(["--pool-name", "other-ids", "--namespace", NAMESPACE,
                                            "--output", str(output), *expected_target(served)])
            assert code == 2, name
            assert "aux_layer_ids [1, 3, 4] (the pool serves [0, 2, 5])" in caplog.text, name
            assert not output.exists(), f"{name} trained or wrote before the check"
    finally:
        other.shutdown()
