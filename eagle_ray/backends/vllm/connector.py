"""vLLM KV-connector plug-in that hands captured hidden states back without a disk round trip.

This module is a vLLM plug-in and is loaded only by vLLM: `runner` (this package) names it in the
engine config (`kv_connector_module_path` + the class name), and vLLM imports it inside the
processes that run its scheduler and workers. It is the one eagle_ray module that imports vLLM at
load time; nothing in eagle_ray imports it.

vLLM's `extract_hidden_states` speculative method writes the requested hidden states of every
prompt token into a cache-only KV layer. When a request finishes, the scheduler side
(`request_finished`) keeps its blocks alive and queues a save; on the next engine step the worker
side (`get_finished`) gathers the `[num_tokens, num_ids, H]` states of every request queued for
that step in one pass from those blocks and publishes each request's through the engine's
`handoff.Handoff` (a dictionary in this process, or files in `/dev/shm`). Only TP rank 0
publishes states; with `check_ranks` the other ranks publish their copy of one captured row per
request, which the runner compares with rank 0's (`_publish_rank_check`). On CPU the gather is
synchronous; on GPU nothing in it makes the worker's thread wait: the slots go to the GPU from
pinned memory, and the gather and its copy to pinned host memory run on a side stream, all
non-blocking; the blocks are released only once that copy is done.

vLLM internals this relies on (read from vllm 0.32.0, `vllm/distributed/kv_transfer/kv_connector/
v1/example_hidden_states_connector.py`; check them on every vLLM upgrade):

- module members `ExampleHiddenStatesConnector`, `ExampleHiddenStatesConnectorMetadata`
  (`pending_saves`), `PendingSave` (`req_id`, `block_ids`, `token_ids`) and
  `extract_from_kv_cache(kv_cache, slots, num_tokens)`;
- `get_finished(finished_req_ids)` on the worker, with the step's metadata bound: it calls the
  private hook `_submit_async_write(pending)` once per pending save (a no-op here: the override
  has saved them all first), then drops each finished request that has no entry in
  `_req_copy_events` and reports the others once their `.query()` is true;
- the base class's state: `_kv_transfer_config`, `_is_tp_rank_zero`, `_kv_cache`, `_block_size`,
  `_req_copy_events`, `_req_futures`, `_executor`, `_get_copy_stream()`,
  `_on_write_done(req_id, future)`, and `use_lock`;
- `request_finished(request, block_ids) -> (delay_free, kv_transfer_params)`, whose params reach
  the caller as `RequestOutput.kv_transfer_params`; the scheduler-side `Request.sampling_params`
  (`extra_args`), and the base class's `_request_filenames` (dropped for requests not captured);
- `get_finished_count() == 1`: one rank's report frees a request's blocks, so the ranks past the
  first report nothing, and `register_kv_caches(kv_caches)` runs after distributed init (where
  `get_tensor_model_parallel_rank()` answers).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from eagle_ray.backends.vllm.handoff import (
    CAPTURE_ARG,
    PARAMS_KEY,
    Handoff,
    handoff_from_config,
    handoff_key,
    rank_check_handoff,
    rank_check_key,
)
from eagle_ray.devices import start_hand_over

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


logger = logging.getLogger(__name__)


class _Done:
    """Stands in for a CUDA event when the copy already happened synchronously (CPU)."""

    @staticmethod
    def query() -> bool:
        return True


class EagleRayHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Store-only connector: publishes each finished request's hidden states.

    Configured through `kv_connector_extra_config`: `handoff` (a `Handoff.to_config()`
    dictionary) and `engine_tag` (keeps keys of engines on one host apart). Reuses vLLM's example
    connector for block bookkeeping; overrides only where the data goes.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        handoff = extra("handoff", None)
        if handoff is None:
            raise ValueError(f"{type(self).__name__} needs kv_connector_extra_config['handoff'] "
                             f"(eagle_ray.backends.vllm.runner sets it); build the engine through "
                             f"VLLMEagle3TargetModel")
        self._handoff = handoff_from_config(handoff)
        self._engine_tag = extra("engine_tag", "default")
        self._check_ranks = bool(extra("check_ranks", False))  # TP ranks > 0 publish a row
        self._rank_rows = rank_check_handoff(self._handoff)  # where they publish it
        self._tp_rank = 0  # known once the worker registers its caches
        self.use_lock = False  # readers wait for the hand-off, not for a file lock

    # Scheduler side --------------------------------------------------------------------------

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called by the scheduler once per finished request, before its blocks are freed.

        Keeps the blocks until the worker has gathered the states, and tells the caller the key
        they will be published under (it arrives in `RequestOutput.kv_transfer_params`).
        """
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params else {}
        if not extra.get(CAPTURE_ARG, True):  # text generation: nobody takes these states
            self._request_filenames.pop(request.request_id, None)
            return False, None
        delay, params = super().request_finished(request, block_ids)
        if params is None:
            return delay, None
        return delay, {PARAMS_KEY: handoff_key(self._engine_tag, request.request_id)}

    # Worker side -----------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Called by the worker once per engine step: saves the requests that finished before it
        together (one gather, one copy; vLLM's loop would make one each), then lets vLLM poll
        the copies."""
        self._save(self._step_saves())
        return super().get_finished(finished_req_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:
        """vLLM's per-request save, which its `get_finished` calls after this class's has saved
        the step's requests together: nothing left to do."""

    def _step_saves(self) -> list[PendingSave]:
        """The saves the scheduler queued for this step (what vLLM's `get_finished` submits)."""
        if not self.has_connector_metadata():
            return []
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            return []
        return metadata.pending_saves

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called by the worker once its KV caches exist (after distributed init): the base class
        binds the capture layer's cache; this one also learns its TP rank."""
        super().register_kv_caches(kv_caches)
        self._tp_rank = get_tensor_model_parallel_rank()

    def _save(self, saves: list[PendingSave]) -> None:
        """Gather the states of every request in `saves` in one pass and publish each (TP rank
        0); the other ranks publish their rank check's rows, when asked to."""
        if not saves:
            return
        if not self._is_tp_rank_zero:
            if self._check_ranks:
                self._publish_rank_check(saves)
            return
        assert self._kv_cache is not None
        keys = [handoff_key(self._engine_tag, pending.req_id) for pending in saves]
        lengths = [pending.token_ids.shape[0] for pending in saves]
        slots = torch.cat([self._slots(pending) for pending in saves])
        if self._kv_cache.device.type == "cpu":
            # Advanced indexing gathers into a new tensor: nothing aliases the KV cache.
            states = extract_from_kv_cache(self._kv_cache, slots, len(slots))
            self._publish(keys, states.split(lengths))
            for pending in saves:
                self._req_copy_events[pending.req_id] = _Done()
            return
        self._submit_device_copy([pending.req_id for pending in saves], keys, lengths, slots)

    def _publish_rank_check(self, saves: list[PendingSave]) -> None:
        """This rank's copy of the first captured layer at each request's last token, published
        under `rank_check_key` for the runner to compare with rank 0's: the residual stream is
        the same on every rank, so a capture that read one rank's partial sum (what a graph
        rewrite around the all-reduce could make of it) differs. This rank reports nothing to
        vLLM, so rank 0's copy decides when the blocks are freed; the gather is queued on the
        current stream, behind the forward that wrote the states and before any later forward
        that could reuse the blocks, and nothing on this thread waits."""
        keys = [rank_check_key(handoff_key(self._engine_tag, pending.req_id), self._tp_rank)
                for pending in saves]
        last = torch.stack([self._slots(pending)[-1] for pending in saves])
        if self._kv_cache.device.type == "cpu":
            rows = extract_from_kv_cache(self._kv_cache, last, len(last)).select(1, 0)
            self._publish(keys, rows, self._rank_rows)
            return
        stream = torch.cuda.current_stream(self._kv_cache.device)
        (last,) = start_hand_over([last], self._kv_cache.device, stream).result()
        rows = extract_from_kv_cache(self._kv_cache, last, len(last)).select(1, 0)
        copy = start_hand_over([rows], "cpu", stream)
        published = self._executor.submit(
            lambda: self._publish(keys, copy.result()[0], self._rank_rows))
        published.add_done_callback(lambda f: f.exception() and logger.error(
            "TP rank %d could not publish its rank-check rows: %r", self._tp_rank,
            f.exception()))

    def _slots(self, pending: PendingSave) -> torch.Tensor:
        """The KV-cache slots of the request's tokens, in order: only its own, so the gather is
        its one copy (no trimming)."""
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        return slots[:pending.token_ids.shape[0]]

    def _submit_device_copy(self, req_ids: list[str], keys: list[str], lengths: list[int],
                            slots: torch.Tensor) -> None:
        """GPU: the slots' copy to the GPU (from pinned memory), the gather and its copy to the
        host, queued on a side stream after the forward that wrote the states, none of them
        waited for by this thread (a synchronising copy would stall the worker's main thread);
        published from a thread once the copy has landed."""
        stream = self._get_copy_stream()
        to_gpu = start_hand_over([slots], self._kv_cache.device, stream)  # after the forward
        with torch.cuda.stream(stream):
            (slots,) = to_gpu.result()
            gathered = extract_from_kv_cache(self._kv_cache, slots, len(slots))
        copy = start_hand_over([gathered], "cpu", stream)

        def finish() -> None:
            (host,) = copy.result()
            self._publish(keys, host.split(lengths))

        future = self._executor.submit(finish)
        for req_id in req_ids:
            self._req_copy_events[req_id] = copy  # vLLM polls `.query()`
            self._req_futures[req_id] = future
            future.add_done_callback(lambda f, r=req_id: self._on_write_done(r, f))

    def _publish(self, keys: list[str], states: Sequence[torch.Tensor],
                 handoff: Handoff | None = None) -> None:
        """Each request's states under its own key (views of the step's one gather), through
        the engine's hand-off unless told another."""
        for key, request_states in zip(keys, states, strict=True):
            (handoff or self._handoff).publish(key, request_states)
