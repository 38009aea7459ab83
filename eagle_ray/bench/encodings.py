"""Bytes per supervised token of each target encoding, computed for real target shapes.

Assumes bf16 activations and fp32 probabilities / logits (what a trainer consumes);
`last_hidden_fp8` is `encoding_dtype: fp8` (e4m3 values and an fp32 scale per token and layer).
The tiny target's bytes are measured from real batches by the backend benchmark instead.
"""

from __future__ import annotations

from eagle_ray.bench import emit

# (name, hidden size, vocabulary size) of targets people train drafts for.
REAL_SHAPES = [
    ("llama-3.1-8b", 4096, 128_256),
    ("qwen3-8b", 4096, 151_936),
    ("llama-3.1-70b", 8192, 128_256),
]
DRAFT_VOCAB = 32_000


def bytes_per_token(hidden: int, vocab: int, draft_vocab: int) -> dict[str, int]:
    """Aux states ride along with every encoding; the encodings differ in what else travels."""
    aux = 3 * hidden * 2
    return {
        "last_hidden": aux + hidden * 2,
        "last_hidden_fp8": 3 * hidden + hidden + 4 * 4,
        "logits": aux + vocab * 4,
        "target_probs": aux + draft_vocab * 4 + 1,
    }


def run() -> None:
    for name, hidden, vocab in REAL_SHAPES:
        sizes = bytes_per_token(hidden, vocab, DRAFT_VOCAB)
        for encoding, size in sizes.items():
            emit("encodings", f"bytes_per_token.{encoding}", size, "B/token", model=name,
                 baseline="logits", ratio=round(size / sizes["logits"], 4))
        emit("encodings", "bytes_per_token.last_hidden_fp8", sizes["last_hidden_fp8"], "B/token",
             model=name, baseline="last_hidden", ratio=round(
                 sizes["last_hidden_fp8"] / sizes["last_hidden"], 4))
