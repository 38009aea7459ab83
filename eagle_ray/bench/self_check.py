"""The self-check's false alarms and catches on a real vLLM engine: rows of random prompts whose
greedy token the check refuses with the right capture (a false alarm stops a user's job), and
rows it catches with a capture one layer off (the classic layer-id convention bug).

Each target runs on one vLLM engine (the CPU build here) that captures two states per row:
vLLM's id `N` (the final pre-norm state, the right capture) and id `N - 1` (the input of the last
layer: what a canonical id passed untranslated captures). The check's per-row rule
(`eagle_ray.backends.self_check.refused_rows`) is applied to the target head over each, against the
engine's own greedy token. Two targets: the kit's tiny Llama (hidden 128, vocabulary 1,024), and
a randomly initialised Llama with Llama-3.1-8B's hidden size, vocabulary and layer shapes but two
layers (the head's rounding depends on the hidden size and the vocabulary; the weights need not
be trained for that). Rows that the one-layer-off state's head argmax already agrees with cannot
be caught by any rule; they are counted apart (`off_by_one_same_argmax`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from eagle_ray.bench import emit

logger = logging.getLogger(__name__)

# Llama-3.1-8B's shapes, two decoder layers (about 3 GB of bf16 weights, built once and cached).
WIDE_SHAPE: dict[str, int] = {"hidden": 4096, "vocab": 128_256, "layers": 2,
                              "intermediate": 14_336, "heads": 32, "kv_heads": 8}
BATCH_ROWS = 128  # rows per engine call
LENGTHS = (2, 16)  # prompt lengths, drawn uniformly in this range (inclusive)


def wide_target(hidden: int, vocab: int, layers: int, intermediate: int, heads: int,
                kv_heads: int, seed: int = 0) -> Path:
    """A randomly initialised bf16 Llama of these shapes (no tokenizer: vLLM serves token
    ids), built on first use under the kit's cache and reused."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle_ray.tiny import cache_root

    name = f"llama-h{hidden}-v{vocab}-l{layers}-i{intermediate}-a{heads}-kv{kv_heads}-s{seed}"
    path = cache_root() / "self-check" / name
    if (path / "config.json").exists():
        return path
    logger.info("building a random %s target at %s (once)", name, path)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         max_position_embeddings=512, rope_theta=500_000.0,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        model.save_pretrained(Path(tmp) / "model")
        try:
            os.rename(Path(tmp) / "model", path)
        except OSError:  # a concurrent builder won the race
            if not (path / "config.json").exists():
                raise
    return path


def random_prompts(vocab: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random token ids `[rows, S]` and their attention mask, lengths drawn in
    `LENGTHS`."""
    from eagle_ray.testing import random_micro_batch

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(LENGTHS[0], LENGTHS[1] + 1, (rows,), generator=generator).tolist()
    ids, attention_mask, _ = random_micro_batch(vocab, tuple(lengths), seed=seed)
    return ids, attention_mask


class TwoStateEngine:
    """A vLLM engine (eagle_ray's capturing runner) that captures, per row, the final pre-norm
    state (vLLM id `N`) and the input of the last layer (id `N - 1`), with the target's head as
    the backend loads it."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype,
                 vllm_kwargs: dict[str, Any] | None = None) -> None:
        from transformers import AutoConfig

        from eagle_ray.backends.vllm.runner import VLLMTargetRunner
        from eagle_ray.contract.checkpoint import load_embedding_and_head

        config = AutoConfig.from_pretrained(model_path).get_text_config()
        layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        _, self.head = load_embedding_and_head(model_path, dtype)
        self.runner = VLLMTargetRunner(str(model_path), [layers - 1, layers], config.hidden_size,
                                       dtype, multiprocess=True, max_call_tokens=4096,
                                       vllm_kwargs=vllm_kwargs)
        self.engine = "vllm-cpu" if self.runner.is_cpu else "vllm-gpu"
        if not self.runner.is_cpu and torch.cuda.is_available():
            self.head = self.head.to("cuda")  # where the backend keeps it (and checks) on a GPU

    def capture(self, ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(engine's greedy tokens `[B]`, right final states `[B, H]`, one-layer-off `[B, H]`)
        at each row's last position."""
        out = self.runner.run(ids, attention_mask)
        device = self.head.lm_head.weight.device
        last = torch.stack([row[-1] for row in out.rows]).to(device)  # [B, 2, H]: N - 1, N
        return out.next_token_ids.to(device), last[:, 1], last[:, 0]

    def shutdown(self) -> None:
        self.runner.shutdown()


def count(engine: TwoStateEngine, rows: int, seed: int = 0) -> dict[str, Any]:
    """Over `rows` random prompts: rows refused with the right capture, rows caught one layer
    off, rows whose one-layer-off argmax equals the engine's token (no rule can catch those),
    and how far short of the best logit the right capture's engine token fell at worst, in
    units of the rule's tolerance (the check refuses above 1)."""
    from eagle_ray.backends.self_check import greedy_shortfall, refused_rows

    dtype = engine.head.lm_head.weight.dtype
    totals: dict[str, Any] = {"rows": 0, "refused_right": 0, "caught_off_by_one": 0,
                              "off_by_one_same_argmax": 0, "worst_right_shortfall": 0.0}
    for start in range(0, rows, BATCH_ROWS):
        n = min(BATCH_ROWS, rows - start)
        tokens, right, off = engine.capture(*random_prompts(engine.vocab_size, n, seed + start))
        with torch.no_grad():
            right_logits, off_logits = engine.head(right).float(), engine.head(off).float()
        totals["rows"] += n
        totals["refused_right"] += int(refused_rows(tokens, right_logits, dtype).sum())
        totals["caught_off_by_one"] += int(refused_rows(tokens, off_logits, dtype).sum())
        totals["off_by_one_same_argmax"] += int((off_logits.argmax(-1) == tokens).sum())
        worst = float(greedy_shortfall(tokens, right_logits, dtype).max())
        totals["worst_right_shortfall"] = max(totals["worst_right_shortfall"], round(worst, 4))
    return totals


def run(model_path: str, rows: int = 1024, dtype: str = "bfloat16",
        wide: dict[str, int] | None = None, tiny: bool = True) -> None:
    """The self-check's false refusals (right capture) and catches (one layer off) on the real
    vLLM engine, on the tiny target (unless not `tiny`) and a Llama-3.1-8B-shaped one (`wide`:
    other shapes)."""
    from eagle_ray.backends.self_check import SELF_CHECK_RULE

    shape = {**WIDE_SHAPE, **(wide or {})}
    targets = {"tiny-llama": lambda: Path(model_path)} if tiny else {}
    targets[f"llama-h{shape['hidden']}-v{shape['vocab']}-{shape['layers']}l"] = \
        lambda: wide_target(**shape)
    for name, path in targets.items():
        engine = TwoStateEngine(path(), getattr(torch, dtype))
        try:
            totals = count(engine, rows)
        finally:
            engine.shutdown()
        logger.info("self-check on %s (%s): %s", name, dtype, totals)
        common = {"target": name, "rows": totals["rows"], "rule": SELF_CHECK_RULE,
                  "dtype": dtype, "engine": engine.engine}
        for metric in ("refused_right", "caught_off_by_one", "off_by_one_same_argmax"):
            emit("self-check", metric, totals[metric], "rows", **common)
        emit("self-check", "worst_right_shortfall", totals["worst_right_shortfall"],
             "tolerances", **common)
