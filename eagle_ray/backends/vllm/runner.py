"""Every vLLM-internal detail of the vLLM backend: engine construction, capture, hand-off, draining.

`VLLMTargetRunner` builds one `vllm.LLM` whose speculative method is `extract_hidden_states`
(capturing vLLM's pre-layer ids) and whose KV connector is eagle_ray's own
(`connector`). Per micro-batch it runs one batched `generate` with `max_tokens=1`,
picks each request's `[num_tokens, num_ids, H]` states up from the hand-off and checks their
length; it returns them as they are (`RunnerOutput.rows`): padding and the shift are the host's
work, off the engine thread. vLLM is imported only when an engine is built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from eagle_ray.backends.base import RunnerOutput, Sampling, TargetRunner, check_ranks_agree
from eagle_ray.backends.vllm import torchvision_shim
from eagle_ray.backends.vllm import vision as vllm_vision
from eagle_ray.backends.vllm.engine_args import (
    TP_EXECUTOR,
    capture_compilation_config,
    check_vllm_kwargs,
)
from eagle_ray.backends.vllm.handoff import (
    CAPTURE_ARG,
    PARAMS_KEY,
    Handoff,
    choose_handoff,
    handoff_key,
    rank_check_handoff,
    rank_check_key,
)
from eagle_ray.contract.images import ImageInputs, ImageTokens
from eagle_ray.data.tokenizer_files import serves_without_tokenizer

logger = logging.getLogger(__name__)

# The KV-connector plug-in that vLLM loads by module path (it imports vLLM: named, not imported).
CONNECTOR_MODULE = "eagle_ray.backends.vllm.connector"
CONNECTOR_CLASS = "EagleRayHiddenStatesConnector"
# Defaults that work on a small CPU machine; any key in vllm_kwargs wins.
CPU_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 512 * 2**20,
    "enable_prefix_caching": False,
}
# On a GPU, vLLM 0.32 would pick the V2 model runner (with Triton) and async scheduling for
# `extract_hidden_states`; the CPU build, where the capture is tested, runs the V1 runner and
# forces async scheduling off. The GPU engine takes the same two (`GPU_ENGINE_ENV` below): the
# capture then runs the tested code, and a prefill-only workload (one sampled token) gains
# nothing from overlapping scheduling. What still differs: CUDA graphs and torch.compile
# (`enforce_eager` is False on GPUs), which change kernels, not what is captured.
GPU_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.85,
    "enable_prefix_caching": False,
    "async_scheduling": False,
}
GPU_ENGINE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # a value set in the environment wins
HANDOFF_TIMEOUT_S = 120.0
# Tokens of one `generate_batch` call the shared-memory ring is sized for, when not told (a pool
# replica tells it its `max_tokens_per_engine_call`, whose default this is).
DEFAULT_CALL_TOKENS = 16384
# vLLM keeps per-process globals (forward context, parallel state) that a second in-process
# engine overwrites: its first engine then returns wrong hidden states. One per process.
_live_inprocess_engines: weakref.WeakSet = weakref.WeakSet()


def cpu_thread_binding(tp_size: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each TP rank its own share of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} needs at least {tp_size} cores on CPU, "
                         f"this process may use {len(cores)}")
    per_rank = len(cores) // tp_size
    groups = [cores[r * per_rank:(r + 1) * per_rank] for r in range(tp_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def allocator_settings_for_engine() -> dict[str, str]:
    """PyTorch allocator settings for the engine without `expandable_segments:True`.

    vLLM refuses every KV connector beside it (connectors that register KV memory for RDMA
    break when the allocator remaps pages); eagle_ray's connector registers nothing -- it copies
    hidden states out -- but the check is vLLM's, and training images commonly set the option.
    Other options are kept."""
    settings = {}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        options = os.environ.get(name, "").split(",")
        if "expandable_segments:True" in (o.strip() for o in options):
            kept = [o for o in options if o.strip() != "expandable_segments:True"]
            settings[name] = ",".join(kept)
            logger.info("%s for the vLLM engine: %r (expandable_segments:True removed; vLLM "
                        "refuses KV connectors beside it)", name, settings[name])
    return settings


def build_llm(engine_kwargs: dict[str, Any], multiprocess: bool,
              env: dict[str, str] | None = None):
    """`vllm.LLM(**engine_kwargs)` with its engine core in this process or its own, and `env`
    set while it starts (restored afterwards)."""
    import vllm.envs
    from vllm import LLM

    # An in-process engine freezes vLLM's environment variables for the whole process
    # (vllm.envs cache); thaw them so this engine sees the settings below.
    vllm.envs.disable_envs_cache()
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0", **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return LLM(**engine_kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def serving_engine(engine_kwargs: dict[str, Any]) -> Iterator[Any]:
    """A plain `vllm.LLM` (no capture; its engine core in its own process), with this platform's
    defaults under `engine_kwargs` and no tokenizer where the checkpoint has none; shut down on
    exit. The evaluation serves a draft through it as `vllm serve` would."""
    from vllm.platforms import current_platform

    kwargs = {**(CPU_DEFAULTS if current_platform.is_cpu() else GPU_DEFAULTS), **engine_kwargs}
    kwargs.setdefault("skip_tokenizer_init", serves_without_tokenizer(kwargs["model"], kwargs))
    llm = build_llm(kwargs, multiprocess=True)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


class VLLMTargetRunner(TargetRunner):
    """Owns one vLLM engine that captures hidden states; see the module docstring.

    `capture_ids` are vLLM's pre-layer ids (`vllm_capture_layer_ids`): the aux layers, then
    the final pre-norm hidden state. Options:

    - `multiprocess`: run the engine core in its own process; None: only when `tp_size > 1` (an
      in-process engine starts about 3x faster -- `eagle-ray bench engine-start` -- and hands
      states over through a dictionary, but there can be one per process).
    - `handoff`: how captured states come back: "inprocess" (a dictionary; in-process engine,
      TP 1), "shm" (one persistent ring per engine in /dev/shm, read as zero-copy views) or
      "file" (a file per request in `handoff_dir`); None: the cheapest that works. Turned into
      a `Handoff` here, once. `handoff_dir`: the directory of "file" (or of "shm": /dev/shm).
    - `handoff_ring_bytes`: the "shm" ring's size; None: room for two calls of
      `max_call_tokens` or `max_model_len` tokens, whichever is more, at least 256 MiB. A
      request that finds it full comes through a file of its own (`handoff_overflows`).
    - `max_call_tokens`: the most tokens one call carries (a pool replica passes its
      `max_tokens_per_engine_call`); `object_store_bytes`: the Ray object store's size on this
      node, which shares /dev/shm with the ring (a ring that would not fit beside it is
      refused, naming the setting to change).
    - `vision`: a vision-language target's placeholder layout (`ImageTokens`); its engine
      takes images (`vision`, this package) and refuses videos. None: a text target.
    """

    def __init__(
        self,
        model_path: str,
        capture_ids: Sequence[int],
        hidden_size: int,
        dtype: torch.dtype,
        tp_size: int = 1,
        trust_remote_code: bool = False,
        vllm_kwargs: dict[str, Any] | None = None,
        multiprocess: bool | None = None,
        handoff: str | None = None,
        handoff_dir: str | None = None,
        handoff_ring_bytes: int | None = None,
        max_model_len_hint: int = 0,
        max_call_tokens: int = DEFAULT_CALL_TOKENS,
        object_store_bytes: int = 0,
        check_ranks: bool = True,
        vision: ImageTokens | None = None,
    ) -> None:
        from vllm.platforms import current_platform

        vllm_kwargs = dict(vllm_kwargs or {})
        check_vllm_kwargs(vllm_kwargs, tp_size)
        tp_from_kwargs = vllm_kwargs.pop("tensor_parallel_size", tp_size)
        if tp_from_kwargs != tp_size:
            raise ValueError(f"tp_size={tp_size} disagrees with vllm_kwargs "
                             f"tensor_parallel_size={tp_from_kwargs}; pass one of them")
        self.capture_ids = list(capture_ids)
        self.vision = vision
        self.tp_size = tp_size
        # With TP, every micro-batch's rows of the first captured layer on each rank are
        # compared with rank 0's (`check_ranks_agree`): the self-check's cover of an aux layer.
        self.check_ranks = check_ranks and tp_size > 1
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.is_cpu = current_platform.is_cpu()
        self.multiprocess = (tp_size > 1) if multiprocess is None else multiprocess
        self.engine_tag = uuid.uuid4().hex[:12]
        self.key_prefix = handoff_key(self.engine_tag, "")  # every key this engine publishes
        # One engine call's captured states size the ring: the tokens of a call, or the longest
        # request the engine accepts if that is more (its max_model_len is known only once it
        # is built; the ring must exist before).
        call_tokens = max(max_call_tokens,
                          int(vllm_kwargs.get("max_model_len") or max_model_len_hint))
        self.handoff: Handoff = choose_handoff(
            handoff, same_process=not self.multiprocess and tp_size == 1,
            key_prefix=self.key_prefix, directory=handoff_dir, ring_bytes=handoff_ring_bytes,
            call_bytes=call_tokens * len(self.capture_ids) * hidden_size * dtype.itemsize,
            object_store_bytes=object_store_bytes)

        engine_kwargs = self._engine_kwargs(model_path, vllm_kwargs, tp_size, trust_remote_code)
        self.llm = self._build_engine(engine_kwargs, tp_size)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        # Drop anything a crashed call left behind when this runner goes away.
        self._finalizer = weakref.finalize(self, self.handoff.discard, self.key_prefix)

    def _engine_kwargs(self, model_path: str, vllm_kwargs: dict[str, Any], tp_size: int,
                       trust_remote_code: bool) -> dict[str, Any]:
        """`vllm.LLM`'s arguments: the platform's defaults, the user's `vllm_kwargs`, then what
        the capture owns (the model, the extract_hidden_states method, this connector)."""
        engine_kwargs = {**(CPU_DEFAULTS if self.is_cpu else GPU_DEFAULTS), **vllm_kwargs}
        if self.vision is not None:
            engine_kwargs = vllm_vision.vision_engine_kwargs(engine_kwargs)
        engine_kwargs["compilation_config"] = capture_compilation_config(
            engine_kwargs.get("compilation_config"))
        if tp_size > 1:
            # The ranks run as this process's workers (in a pool: the replica holds their GPUs);
            # inside a Ray placement group vLLM would pick its Ray executor by itself.
            engine_kwargs.setdefault("distributed_executor_backend", TP_EXECUTOR)
        engine_kwargs.update(
            model=str(model_path),
            dtype=str(self.dtype).removeprefix("torch."),
            tensor_parallel_size=tp_size,
            trust_remote_code=trust_remote_code,
            # Prompts stay token ids and outputs are not detokenised, so a weights-only folder
            # serves as it is; with a tokenizer (the checkpoint's, or vllm_kwargs["tokenizer"])
            # vLLM's `LLM` warms a chat template with it (without one, it logs a traceback).
            skip_tokenizer_init=serves_without_tokenizer(model_path, vllm_kwargs),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {
                    "hf_config": {"eagle_aux_hidden_state_layer_ids": self.capture_ids}
                },
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR_CLASS,
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "handoff": self.handoff.to_config(),
                    "engine_tag": self.engine_tag,
                    "check_ranks": self.check_ranks,
                },
            },
        )
        return engine_kwargs

    def _build_engine(self, engine_kwargs: dict[str, Any], tp_size: int):
        if not self.multiprocess:
            if len(_live_inprocess_engines):
                raise RuntimeError(
                    "this process already runs an in-process vLLM engine, and vLLM's process-wide "
                    "state cannot hold two; shut the other down first (.shutdown()) or build this "
                    "one with multiprocess=True"
                )
            _live_inprocess_engines.add(self)
        env = allocator_settings_for_engine()
        if not self.is_cpu:
            env.update({k: os.environ.get(k, v) for k, v in GPU_ENGINE_ENV.items()})
        # vLLM's "auto" binding wants one NUMA node per TP rank; split this node's cores instead.
        if self.is_cpu and tp_size > 1 and os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                          "auto") == "auto":
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp_size)
        if self.vision is not None:
            torchvision_shim.install()  # (the plugin does too, in each of vLLM's processes)
        started = time.perf_counter()
        llm = build_llm(engine_kwargs, self.multiprocess, env)
        self.start_seconds = time.perf_counter() - started
        logger.info("vLLM engine up in %.1fs (capture ids %s, tp=%d, %s engine core, %s hand-off)",
                    self.start_seconds, self.capture_ids, tp_size,
                    "multiprocess" if self.multiprocess else "in-process", self.handoff.to_config())
        return llm

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            images: ImageInputs | None = None) -> RunnerOutput:
        """One batched `generate` (images: `vision.image_prompts`); rows' states, unpadded."""
        from vllm import SamplingParams

        lengths = attention_mask.sum(dim=1).tolist()
        prompts = vllm_vision.image_prompts(input_ids, lengths, images, self.vision)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        keys = [(o.kv_transfer_params or {}).get(PARAMS_KEY) for o in outputs]
        try:
            if not self.multiprocess:
                self._drain()
            if images is not None:
                vllm_vision.check_expanded(outputs, input_ids, lengths)
            states = [self._take(key, n) for key, n in zip(keys, lengths, strict=True)]
            if self.check_ranks:
                self._check_ranks(keys, states)
        except BaseException:
            for key in keys:
                if key is not None:
                    self.handoff.discard(key)
            raise
        # The states stay where the hand-off left them (views of the ring, or the connector's
        # tensors): the host stage shifts them into the batch, one copy (RunnerOutput.rows).
        greedy = torch.tensor([o.outputs[0].token_ids[0] for o in outputs], dtype=torch.long)
        positions = vllm_vision.temporal_positions(input_ids, attention_mask, images, self.vision)
        return RunnerOutput(rows=states, next_token_ids=greedy, positions=positions)

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Generate continuations with the same engine (vLLM holds one per process). These
        requests are flagged so the connector captures nothing for them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=sampling.max_new_tokens,
                                temperature=sampling.temperature, top_p=sampling.top_p,
                                seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids),
                                detokenize=False, extra_args={CAPTURE_ARG: False})
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    use_tqdm=False)
        if not self.multiprocess:
            self._drain()
        return [list(o.outputs[0].token_ids) for o in outputs]

    def _drain(self) -> None:
        """Step an in-process engine until the scheduler is empty.

        The connector gathers a request's states one engine step *after* it finishes; a
        multiprocess engine core runs that step by itself, an in-process one only when stepped.
        """
        engine = self.llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        while scheduler.has_requests():
            engine.step()

    def _check_ranks(self, keys: list[str], states: list[torch.Tensor]) -> None:
        """Each TP rank's copy of the first captured layer at every request's last token
        (published by the connector) against rank 0's, which the supervision comes from."""
        rank_zero = torch.stack([request_states[-1, 0] for request_states in states])
        published = rank_check_handoff(self.handoff)
        for rank in range(1, self.tp_size):
            rows = torch.stack([self._wait_for(rank_check_key(key, rank), (self.hidden_size,),
                                               published) for key in keys])
            check_ranks_agree(rank_zero, rows, rank, min(self.capture_ids))

    def _take(self, key: str | None, num_tokens: int) -> torch.Tensor:
        if key is None:
            raise RuntimeError(
                "vLLM returned no hidden-state key for a request: the eagle_ray KV connector is "
                "not active in this engine (kv_transfer_config overridden?)"
            )
        return self._wait_for(key, (num_tokens, len(self.capture_ids), self.hidden_size),
                              self.handoff)

    def _wait_for(self, key: str, shape: tuple[int, ...], handoff: Handoff) -> torch.Tensor:
        """What the connector published under `key` in `handoff`, once it is there (`shape`,
        checked)."""
        deadline = time.monotonic() + HANDOFF_TIMEOUT_S
        delay = 1e-4
        while True:
            states = handoff.take(key, shape, self.dtype)
            if states is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"hidden states {key} did not arrive within "
                                   f"{HANDOFF_TIMEOUT_S:.0f}s; is the vLLM engine alive?")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        if tuple(states.shape) != shape:
            raise RuntimeError(f"vLLM handed back hidden states of shape {list(states.shape)} "
                               f"under {key}; expected {list(shape)}")
        return states

    @property
    def handoff_overflows(self) -> int:
        """Requests whose states found the shared-memory ring full and came through a file."""
        return self.handoff.overflows

    def shutdown(self) -> None:
        """Stop the engine (and its processes) and drop any leftover hand-off data."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        _live_inprocess_engines.discard(self)
        self._finalizer()
