"""Does a replica's engine ever wait on the host? The replica pipeline against the design before it.

A GPU forward leaves the host's cores free, but what follows it is host work: the captured
states are shifted into the batch, encoded and handed to Ray. If the engine thread does that work
too, the GPU idles meanwhile. `eagle-ray bench replica` runs one pool replica three ways, side by
side in one run: `pipelined` (`replica_pipeline: true`: the engine thread runs only the engine,
and the host stage shifts each row once into reused buffers), `serial` (`false`: the same host
work on the engine thread) and `before` (the design this replaced: the engine thread pads the
rows into fresh zeroed tensors through a reshape temporary, then shifts and encodes), with an
engine stand-in
shaped like a GPU engine at the 8B recipe: each call is `tokens_per_call` tokens whose forward
takes `forward_s` (the host waits, as for a CUDA forward) and whose captured states (three aux
layers and the final state, `hidden` wide, bf16) arrive in host memory as vLLM's hand-off leaves
them. A client streams full engine calls through the pool and receives every result (a GPU
trainer's copy to its device costs the host no work, so it touches one value each). Reported:
`engine_busy_share`, the forward's share of wall time (calls x `forward_s` / wall: what a GPU
computes; in the `before` design the replica's own `engine_s` also counted the padding), the host
stage's share (`host_s` / wall), and supervision tokens/s, each against `before`.
"""

from __future__ import annotations

import collections
import time

import ray
import torch
from torch import nn

from eagle_ray.backends.base import RunnerEagle3TargetModel, RunnerOutput, TargetRunner
from eagle_ray.bench import NAMESPACE, emit
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
from eagle_ray.testing import random_micro_batch

BACKEND = "eagle_ray.bench.replica:gpu_shaped_backend"
ROWS = 4  # a call's rows (16,384 tokens as 4 rows of 4,096)


class GpuShapedRunner(TargetRunner):
    """Sleeps `forward_s` per call (the GPU's time), then returns each row's states as views of
    one host buffer (the hand-off's ring: no per-call allocation or copy); `pad_as_before`: padded
    the way the vLLM runner did before the replica pipeline."""

    def __init__(self, hidden: int, max_tokens: int, forward_s: float,
                 pad_as_before: bool) -> None:
        self.forward_s, self.pad_as_before = forward_s, pad_as_before
        self.captured = torch.randn(max_tokens, 4, hidden).to(torch.bfloat16)

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        time.sleep(self.forward_s)
        rows, start = [], 0
        for n in attention_mask.sum(dim=1).tolist():
            rows.append(self.captured[start:start + n])
            start += n
        return _padded_as_before(rows, *input_ids.shape) if self.pad_as_before \
            else RunnerOutput(rows=rows)


def _padded_as_before(rows: list[torch.Tensor], batch: int, seq: int) -> RunnerOutput:
    """The vLLM runner's padding before the pipeline: fresh zeroed tensors, and the slice of
    the aux layers reshaped (a full temporary) before its copy."""
    hidden = rows[0].shape[-1]
    aux = torch.zeros(batch, seq, 3 * hidden, dtype=rows[0].dtype)
    last = torch.zeros(batch, seq, hidden, dtype=rows[0].dtype)
    for row, states in enumerate(rows):
        n = states.shape[0]
        aux[row, :n] = states[:, :3].reshape(n, 3 * hidden)
        last[row, :n] = states[:, 3]
    return RunnerOutput(aux_hidden_states=aux, last_hidden=last)


def gpu_shaped_backend(config: PoolConfig) -> RunnerEagle3TargetModel:
    """Pool backend factory: `backend_kwargs` `hidden`, `tokens_per_call`, `forward_s`,
    `pad_as_before`."""
    options = config.backend_kwargs
    hidden, tokens = options["hidden"], options["tokens_per_call"]
    vocab = 64  # the head is not on this path (last_hidden encoding, no self-check)
    return RunnerEagle3TargetModel(
        GpuShapedRunner(hidden, tokens, options["forward_s"], options["pad_as_before"]),
        num_hidden_layers=8,
        vocab_size=vocab, aux_layer_ids=[1, 3, 4], embedding=nn.Embedding(vocab, hidden),
        head=TargetHead(nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)),
        max_length=tokens)


DESIGNS = {"pipelined": (True, False), "serial": (False, False), "before": (False, True)}


def run(hidden: int = 4096, tokens_per_call: int = 16384, forward_s: float = 0.4,
        calls: int = 16, rounds: int = 2) -> None:
    """Each round streams `calls` engine calls through a replica of each design."""
    if not ray.is_initialized():
        call_bytes = tokens_per_call * 4 * hidden * 2
        ray.init(num_cpus=8, object_store_memory=max(2**30, 6 * call_bytes),
                 include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    seq = tokens_per_call // ROWS
    batches = [random_micro_batch(64, (seq,) * ROWS, seed=i) for i in range(calls)]
    pools = {design: TargetPool.create(PoolConfig(
        backend=BACKEND, name=f"bench-replica-{design}", namespace=NAMESPACE,
        cpus_per_bundle=1.0, replica_pipeline=pipelined,
        max_tokens_per_engine_call=tokens_per_call,
        max_outstanding_tokens_per_replica=4 * tokens_per_call,
        backend_kwargs={"hidden": hidden, "tokens_per_call": tokens_per_call,
                        "forward_s": forward_s, "pad_as_before": pad_as_before}))
        for design, (pipelined, pad_as_before) in DESIGNS.items()}
    try:
        runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        for _ in range(rounds):  # interleaved, so drift hits every design alike
            for design, pool in pools.items():
                runs[design].append(_stream(pool, batches, forward_s))
        best = {d: max(results, key=lambda r: r["supervision_tokens_per_s"])
                for d, results in runs.items()}
        shape = {"hidden": hidden, "tokens_per_call": tokens_per_call, "forward_s": forward_s,
                 "dtype": "bfloat16"}
        for metric, unit in (("engine_busy_share", "share"), ("host_stage_share", "share"),
                             ("supervision_tokens_per_s", "tok/s")):
            for design in DESIGNS:
                value = best[design][metric]
                emit("replica", metric, round(value, 3), unit, design=design, **shape,
                     baseline="before", ratio=round(value / max(best["before"][metric], 1e-9),
                                                    3))
    finally:
        for pool in pools.values():
            pool.shutdown()


def _stream(pool: TargetPool, batches: list, forward_s: float) -> dict[str, float]:
    """Stream `batches` (each one full engine call) through `pool`'s replica; the engine's and
    the host stage's shares of the wall time, and tokens/s."""
    client = pool.client(ClientConfig(max_inflight_micro_batches=4, max_inflight_tokens=1 << 30,
                                      max_micro_batches_per_call=1))
    replica = ray.get_actor(pool.config.replica_name(0), namespace=pool.config.namespace)
    list(client.stream(batches[:2]))  # warm-up
    before = ray.get(replica.ready.remote()).engine
    started = time.perf_counter()
    checksum = 0.0
    for batch in client.stream(batches):
        checksum += float(batch.aux_hidden_states[0, 0, 0])  # each result arrived
    wall = time.perf_counter() - started
    after = ray.get(replica.ready.remote()).engine
    tokens = sum(int(b[1].sum()) for b in batches)
    return {"engine_busy_share": len(batches) * forward_s / wall,
            "host_stage_share": (after.host_s - before.host_s) / wall,
            "supervision_tokens_per_s": tokens / wall}
