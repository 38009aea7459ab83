"""Cost of handing captured hidden states from vLLM's worker to the caller, per token.

Compares each hand-off's publish + take against a copy of the same bytes into warm memory (the
floor any hand-off pays at least once), for a request of `[tokens, 4, H]` states: `shm_ring`
(the default across processes: one persistent region per engine, taken as a view), `shm_files`
(a fresh /dev/shm file per request, the hand-off before the ring), `file` (files under /tmp)
and `inprocess` (a dictionary).
"""

from __future__ import annotations

import tempfile
import uuid

import torch

from eagle_ray.backends.vllm.handoff import (
    SHM_DIR,
    FileHandoff,
    InProcessHandoff,
    choose_handoff,
    handoff_from_config,
    handoff_key,
)
from eagle_ray.bench import best_seconds, emit

SHAPES = [(512, 4096, torch.bfloat16), (2048, 4096, torch.bfloat16), (512, 128, torch.float32)]


def run(repeats: int = 5) -> None:
    for tokens, hidden, dtype in SHAPES:
        states = torch.randn(tokens, 4, hidden).to(dtype)
        # The floor: one copy into memory that is already faulted in (a fresh allocation would
        # also pay the page faults the ring exists to avoid).
        into = torch.empty_like(states)
        copy_s = best_seconds(lambda s=states, into=into: into.copy_(s), repeats)
        prefix = handoff_key(f"bench{uuid.uuid4().hex[:8]}", "")
        reader = choose_handoff("shm", same_process=False, key_prefix=prefix)
        with tempfile.TemporaryDirectory() as file_dir:
            handoffs = {"inprocess": (InProcessHandoff(),) * 2,
                        "shm_ring": (handoff_from_config(reader.to_config()), reader),
                        "shm_files": (FileHandoff(SHM_DIR),) * 2,
                        "file": (FileHandoff(file_dir),) * 2}
            for mode, (writer, taker) in handoffs.items():
                key = f"{prefix}{mode}"

                def round_trip(writer=writer, taker=taker, key=key, s=states):
                    writer.publish(key, s)
                    # The runner copies the states out once (into the padded batch) and drops
                    # them; a view of the ring is freed then.
                    taker.take(key, tuple(s.shape), s.dtype)

                seconds = best_seconds(round_trip, repeats)
                emit("handoff", "seconds_per_token", seconds / tokens, "s/token", mode=mode,
                     tokens=tokens, hidden=hidden, dtype=str(dtype).removeprefix("torch."),
                     mb=round(states.numel() * states.element_size() / 2**20, 2),
                     baseline="memcpy_warm", ratio=float(f"{seconds / copy_s:.3g}"))
        reader.discard(prefix)
