"""How vLLM serves an exported draft. The evaluation's engines and the `vllm serve` command a job
prints are all built from one `DraftServing`, so the command is exactly what was evaluated:
the target's checkpoint, dtype and tensor-parallel size, and the draft as its speculative model
(`eagle3` for EAGLE-3 and P-EAGLE drafts, `dflash` for DFlash ones); the evaluation's greedy
reference is the same engine without the draft.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

TP_EXECUTOR = "mp"  # as the pool's replicas: the TP ranks are the process's own workers


@dataclasses.dataclass(frozen=True)
class DraftServing:
    """A draft served by vLLM as its target's speculative model: EAGLE-3 (chained), P-EAGLE
    (an `eagle3` draft drafting in parallel) or DFlash (the `dflash` method)."""

    model_path: str
    draft_dir: str
    dtype: str  # the target's dtype as vLLM names it ("bfloat16", "float32", ...)
    tp_size: int = 1
    tokenizer: str | None = None  # the target's tokenizer, where its folder has none
    kind: str = "eagle3"  # the exported draft's kind (`DraftSpec.kind`)

    @classmethod
    def for_target(cls, model_path: str, draft_dir: str | Path, dtype: str = "auto",
                   tp_size: int = 1, tokenizer: str | None = None) -> DraftServing:
        """`dtype` "auto" is the checkpoint's own (read from its config.json)."""
        from transformers import AutoConfig

        from eagle_ray.contract.checkpoint import resolve_dtype
        from eagle_ray.draft.export import exported_kind

        text_config = AutoConfig.from_pretrained(model_path).get_text_config()
        resolved = resolve_dtype(None if dtype == "auto" else dtype, text_config)
        return cls(str(model_path), str(draft_dir), str(resolved).removeprefix("torch."),
                   tp_size, tokenizer, exported_kind(draft_dir))

    def speculative_config(self, k: int) -> dict[str, Any]:
        """vLLM's `speculative_config` drafting `k` tokens per step: chained for an EAGLE-3
        draft, in one forward for a P-EAGLE one (`parallel_drafting`, which vLLM never turns on
        by itself for an `eagle3` draft: without it the draft would run as a plain chain), one
        block of 1 + k slots for a DFlash one (the `dflash` method drafts in parallel)."""
        from eagle_ray.draft.kinds import draft_class

        kind = draft_class(self.kind)
        spec = {"method": kind.vllm_method, "model": self.draft_dir, "num_speculative_tokens": k}
        if kind.vllm_parallel_drafting:
            spec["parallel_drafting"] = True
        return spec

    def target_engine_kwargs(self) -> dict[str, Any]:
        """`vllm.LLM` arguments serving the target alone, as `engine_kwargs` serves it but
        without the draft: the reference whose greedy output speculation must not change."""
        kwargs = {"model": self.model_path, "dtype": self.dtype,
                  "tensor_parallel_size": self.tp_size}
        if self.tp_size > 1:
            kwargs["distributed_executor_backend"] = TP_EXECUTOR
        if self.tokenizer:
            kwargs["tokenizer"] = self.tokenizer
        return kwargs

    def engine_kwargs(self, k: int) -> dict[str, Any]:
        """`vllm.LLM` arguments serving the draft at `k` (the same as `command(k)`)."""
        return {**self.target_engine_kwargs(), "speculative_config": self.speculative_config(k)}

    def command(self, k: int) -> str:
        """`vllm serve` with the draft as the target's speculative model at `k`."""
        parts = ["vllm", "serve", shlex.quote(self.model_path), "--dtype", self.dtype]
        if self.tp_size > 1:
            parts += ["--tensor-parallel-size", str(self.tp_size)]
        if self.tokenizer:
            parts += ["--tokenizer", shlex.quote(self.tokenizer)]
        spec = json.dumps(self.speculative_config(k))
        return " ".join(parts + ["--speculative-config", shlex.quote(spec)])
