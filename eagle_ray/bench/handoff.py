"""Cost of handing captured hidden states from vLLM's worker to the caller, per token.

Compares each hand-off's publish + take against a plain memcpy of the same bytes (the floor any
hand-off pays at least once), for a request of `[tokens, 4, H]` states.
"""

from __future__ import annotations

import tempfile
import uuid

import torch

from eagle_ray.bench import best_seconds, emit
from eagle_ray.vllm_handoff import SHM_DIR, FileHandoff, InProcessHandoff

SHAPES = [(512, 4096, torch.bfloat16), (2048, 4096, torch.bfloat16), (512, 128, torch.float32)]


def run(repeats: int = 5) -> None:
    for tokens, hidden, dtype in SHAPES:
        states = torch.randn(tokens, 4, hidden).to(dtype)
        copy_s = best_seconds(lambda s=states: s.clone(), repeats)
        with tempfile.TemporaryDirectory() as file_dir:
            handoffs = {"inprocess": InProcessHandoff(), "shm": FileHandoff(SHM_DIR),
                        "file": FileHandoff(file_dir)}
            for mode, handoff in handoffs.items():
                key = f"eagle_ray-bench-{uuid.uuid4().hex}"

                def round_trip(handoff=handoff, key=key, s=states):
                    handoff.publish(key, s)
                    return handoff.take(key, tuple(s.shape), s.dtype)

                seconds = best_seconds(round_trip, repeats)
                emit("handoff", "seconds_per_token", seconds / tokens, "s/token", mode=mode,
                     tokens=tokens, hidden=hidden, dtype=str(dtype).removeprefix("torch."),
                     mb=round(states.numel() * states.element_size() / 2**20, 2),
                     baseline="memcpy", ratio=round(seconds / copy_s, 3))
