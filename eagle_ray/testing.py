"""Test doubles and inputs for tests and benchmarks that are *about something other than the
engine* (the pool's routing, failures and scaling): a fixed-latency synthetic backend whose output
is a checkable function of its input, and random micro-batches. The built-in tiny target that the
main job uses is `eagle_ray.tiny`.
"""

from __future__ import annotations

import os
import time

import ray
import torch
from torch import nn

from eagle_ray.backends.base import (
    RunnerEagle3TargetModel,
    RunnerOutput,
    Sampling,
    SelfCheckError,
    TargetRunner,
)
from eagle_ray.contract.target_head import TargetHead


def random_micro_batch(vocab_size: int, lengths: tuple[int, ...] = (17, 9, 30, 4), seed: int = 0):
    """Right-padded rows of random ids with the given lengths; loss on each row's second half."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.randint(3, vocab_size, (n,), generator=generator)
        attention_mask[i, :n] = 1
        loss_mask[i, n // 2 : n] = 1
    return input_ids, attention_mask, loss_mask


class SyntheticRunner(TargetRunner):
    """A stand-in engine for tests and benchmarks *about the pool* (routing, failures, scaling):
    hidden states are a cheap deterministic function of the token ids and position, produced
    after a fixed delay, so every result can be checked against its own input."""

    def __init__(self, hidden_size: int, seconds_per_call: float, seconds_per_token: float,
                 fail_once_marker: str | None = None, hold_while: str | None = None,
                 hold_first_call_only: bool = False, self_check_failure: bool = False,
                 out_of_memory_above_tokens: int | None = None,
                 broken_by_out_of_memory: bool = False):
        self.hidden_size = hidden_size
        self.seconds_per_call = seconds_per_call
        self.seconds_per_token = seconds_per_token
        self.fail_once_marker = fail_once_marker  # file: the first engine to see token 0 fails
        self.hold_while = hold_while  # file: calls do not return while it exists (a test's gate)
        self.hold_first_call_only = hold_first_call_only  # only the first call of any replica
        self.self_check_failure = self_check_failure  # every call fails the self-check
        # An engine call of more tokens runs out of memory (torch's error, as on a GPU); with
        # `broken_by_out_of_memory` every call fails the self-check after that.
        self.out_of_memory_above_tokens = out_of_memory_above_tokens
        self.broken_by_out_of_memory = broken_by_out_of_memory

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        if self.self_check_failure:
            raise SelfCheckError("synthetic self-check failure: the engine's greedy token is not "
                                 "the head's argmax (layer-id convention)")
        if self.fail_once_marker and bool((input_ids[attention_mask.bool()] == 0).any()):
            try:
                with open(self.fail_once_marker, "x"):
                    pass
            except FileExistsError:
                pass
            else:
                raise RuntimeError("synthetic engine failure (fail_once_marker)")
        tokens = int(attention_mask.sum())
        if self.out_of_memory_above_tokens is not None \
                and tokens > self.out_of_memory_above_tokens:
            self.self_check_failure = self.broken_by_out_of_memory
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (synthetic: an engine call of "
                f"{tokens} tokens, above out_of_memory_above_tokens="
                f"{self.out_of_memory_above_tokens})")
        time.sleep(self.seconds_per_call + self.seconds_per_token * tokens)
        self._hold()
        return RunnerOutput(aux_hidden_states=synthetic_aux_states(input_ids, self.hidden_size),
                            last_hidden=-input_ids.float().unsqueeze(-1).expand(
                                *input_ids.shape, self.hidden_size).clone())


    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """A checkable stand-in for generation: the prompt's last ids, in reverse, then the
        first stop token; held by the gate like `run`."""
        time.sleep(self.seconds_per_call)
        self._hold()
        return [synthetic_answer(p, sampling) for p in prompts]

    def _hold(self) -> None:
        """Wait while the gate file exists (for the first call only, if so configured)."""
        if self.hold_while and (not self.hold_first_call_only or _first(self.hold_while)):
            hold_while_exists(self.hold_while)


def hold_while_exists(gate: str) -> None:
    """A test's gate: wait while the file `gate` exists; a held call marks `<gate>.holding`, so
    a test can wait until a call is really on an engine."""
    if os.path.exists(gate):
        open(f"{gate}.holding", "a").close()
    while os.path.exists(gate):
        time.sleep(0.01)


class GatedRunner(TargetRunner):
    """Another engine's runner whose calls wait while a gate file exists (`hold_while_exists`):
    a real target that a test can hold at the moment it chooses."""

    def __init__(self, runner: TargetRunner, hold_while: str) -> None:
        self.runner, self.hold_while = runner, hold_while

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        hold_while_exists(self.hold_while)
        return self.runner.run(input_ids, attention_mask)

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        hold_while_exists(self.hold_while)
        return self.runner.complete(prompts, sampling)


def gated_hf_target(config) -> RunnerEagle3TargetModel:
    """Pool backend factory (`backend: "eagle_ray.testing:gated_hf_target"`): the HF backend on
    `target.model_path`, its calls held while `backend_kwargs["hold_while"]` exists."""
    from eagle_ray.backends.hf import HFEagle3TargetModel

    target = HFEagle3TargetModel.from_pretrained(
        config.model_path, aux_layer_ids=config.aux_layer_ids,
        dtype=None if config.dtype == "auto" else config.dtype)
    target.runner = GatedRunner(target.runner, config.backend_kwargs["hold_while"])
    return target


def poisoned_hf_target(config) -> RunnerEagle3TargetModel:
    """Pool backend factory (`backend: "eagle_ray.testing:poisoned_hf_target"`): the HF backend
    on `target.model_path` whose input embedding writes NaN wherever a row holds a poisoned
    token (a broken kernel or weight for that token: the real forward carries it on, to those
    rows only). `backend_kwargs["poison"]`: `[token, replica indices or None]` pairs; None
    poisons the token on every replica (the target's own fault), indices only those (broken
    replicas)."""
    from eagle_ray.backends.hf import HFEagle3TargetModel

    target = HFEagle3TargetModel.from_pretrained(
        config.model_path, aux_layer_ids=config.aux_layer_ids,
        dtype=None if config.dtype == "auto" else config.dtype)
    name = ray.get_runtime_context().get_actor_name()
    tokens = [token for token, replicas in config.backend_kwargs["poison"]
              if replicas is None or name in {config.replica_name(i) for i in replicas}]

    def poison(module, args, out):
        poisoned = torch.isin(args[0], torch.tensor(tokens, device=args[0].device))
        return out.masked_fill(poisoned.unsqueeze(-1), float("nan"))
    target.model.get_input_embeddings().register_forward_hook(poison)
    return target


def synthetic_answer(prompt: list[int], sampling: Sampling) -> list[int]:
    """What `SyntheticRunner.complete` generates for `prompt`."""
    answer = list(reversed(prompt[-min(4, sampling.max_new_tokens - 1):]))
    return answer + list(sampling.stop_token_ids[:1])


def _first(path: str) -> bool:
    """True for the first caller on this machine (across processes) to ask about `path`."""
    try:
        with open(f"{path}.first", "x"):
            return True
    except FileExistsError:
        return False


def synthetic_aux_states(input_ids: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """What `SyntheticRunner` returns as aux states: `[B, S, 3H]`, token id times (1..3H)."""
    scale = torch.arange(1, 3 * hidden_size + 1, dtype=torch.float32)
    return input_ids.float().unsqueeze(-1) * scale


def fixed_latency_target(config) -> RunnerEagle3TargetModel:
    """Pool backend factory (`backend: "eagle_ray.testing:fixed_latency_target"`).

    `backend_kwargs`: `vocab_size` (1024), `hidden_size` (8), `seconds_per_call` (0),
    `seconds_per_token` (0), the fault injections of `SyntheticRunner` (`fail_once_marker`,
    `hold_while`, `hold_first_call_only`, `self_check_failure`, `out_of_memory_above_tokens`,
    `broken_by_out_of_memory`), `hold_restart_while`: a
    file; a replica that Ray restarts does not come back while it exists (a test's gate), and
    `fail_start_while` / `abort_start_while`: a file; a replica built while it exists raises /
    its process exits (no exception to catch) while building its backend.
    """
    options = {"vocab_size": 1024, "hidden_size": 8, "seconds_per_call": 0.0,
               "seconds_per_token": 0.0, **config.backend_kwargs}
    vocab, hidden = options.pop("vocab_size"), options.pop("hidden_size")
    restart_gate = options.pop("hold_restart_while", None)
    start_failure = options.pop("fail_start_while", None)
    if start_failure and os.path.exists(start_failure):
        raise RuntimeError("synthetic start-up failure (fail_start_while)")
    start_abort = options.pop("abort_start_while", None)
    if start_abort and os.path.exists(start_abort):
        os._exit(1)
    if restart_gate and ray.get_runtime_context().was_current_actor_reconstructed:
        while os.path.exists(restart_gate):
            time.sleep(0.01)
    runner = SyntheticRunner(hidden, **options)
    return RunnerEagle3TargetModel(
        runner, num_hidden_layers=8, vocab_size=vocab, aux_layer_ids=[1, 3, 4],
        embedding=nn.Embedding(vocab, hidden),
        head=TargetHead(nn.RMSNorm(hidden), nn.Linear(hidden, vocab, bias=False)),
        max_length=4096,
    )
