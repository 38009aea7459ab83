"""The built-in tiny target and chat data: the embedded default of the main job.

`make run` trains a draft with no model or data given: the target is a small Llama (or Qwen3)
with random weights and a byte-level BPE tokenizer trained here on a generated chat corpus, and
the data is that corpus (`{"messages": [...]}` conversations). Nothing is downloaded. Everything is
deterministic (same seed, same files) and cached on disk, and shaped so that vLLM's CPU kernels
accept it (head_dim 64) and the default aux ids are valid. Tests and benchmarks use it too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KIT_VERSION = 3  # bump when anything below changes what gets built
ARCHITECTURES = ("llama", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2")
# Mixture-of-experts shapes (4 experts, 2 per token), small enough for the CPU engine.
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v2")
# Assistant turns sit inside {% generation %} so `return_assistant_tokens_mask` marks them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """The special tokens and chat template of a locally trained tokenizer: the kit's own, or
    one shaped like a model family's (for tests against stock chat templates)."""

    special_tokens: tuple[str, ...]
    eos_token: str
    chat_template: str
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # Word boundaries as SentencePiece marks them ("▁word", Llama-2 / Mistral style) instead
    # of byte-level BPE's (GPT-2 / Llama-3 / Qwen style).
    metaspace: bool = False


KIT_TOKENIZER = TokenizerSpec(
    special_tokens=("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|end|>"),
    eos_token="<|eos|>", bos_token="<|bos|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)

LM_HEAD_STD = 0.3
# Pre-training of the main job's tiny target (bump the version when any of these change).
PRETRAIN_VERSION = 2
PRETRAIN_STEPS = 250
PRETRAIN_BATCH = 32
PRETRAIN_CONVERSATIONS = 4000
PRETRAIN_SEED = 1000  # the corpus it learns from; the main job's data uses seed 0

_COUNTRIES = {
    "France": "Paris", "Japan": "Tokyo", "Peru": "Lima", "Kenya": "Nairobi", "Canada": "Ottawa",
    "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago", "India": "New Delhi",
    "Spain": "Madrid", "Ghana": "Accra", "Nepal": "Kathmandu",
}
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
_THINGS = ["apple", "car", "house", "river", "book", "garden", "bridge", "lamp", "chair"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def cache_root() -> Path:
    """Where built models and data go: `$EAGLE_RAY_CACHE`, else `~/.cache/eagle_ray`."""
    return Path(os.environ.get("EAGLE_RAY_CACHE", Path.home() / ".cache" / "eagle_ray"))


# The target's phrasings, each slot with skewed weights: the pre-trained target learns them, so
# its answers carry real uncertainty (top probability about 0.4 at each slot) and sampling at
# temperature 1 differs from greedy, while its greedy answers stay the most likely phrasing.
_SLOT_WEIGHTS = (0.4, 0.25, 0.2, 0.15)
_CAPITAL_OPENERS = ("The capital of {c} is {cap}", "The capital city of {c} is {cap}",
                    "In {c}, the capital is {cap}", "{c} has {cap} as its capital")
_CAPITAL_ENDINGS = (".", ", a busy city.", ", an old city.", ", by the way.")
_SUM_OPENERS = ("{A} plus {b} is {s}", "{A} and {b} make {s}", "Adding {a} and {b} gives {s}",
                "{A} plus {b} equals {s}")
_SUM_ENDINGS = (".", ", I think.", ", as always.", ", of course.")
_LOOKS = ("looks", "seems", "is", "feels")
_OPENINGS = ("", "Well, ", "Sure: ", "Simply put, ")
_FIRST_ADJECTIVES = ("bright", "small", "old", "large")
_SECOND_ADJECTIVES = ("quiet", "warm", "new", "clean")


def generate_chat_samples(num_samples: int, seed: int = 0, writer: str = "target"
                          ) -> list[dict]:
    """Deterministic chat samples in the `messages` format (system / user / assistant turns).

    `writer="target"`: answers phrased as the kit's corpus phrases them (what the pre-trained
    tiny target learned to say: at each of three to four slots per answer one of four
    phrasings, drawn with weights 0.4 / 0.25 / 0.2 / 0.15). `writer="other"`: the same questions
    answered in another single phrasing, as in a dataset written by some other model -- the
    main job's data, whose answers `eagle-ray regenerate` replaces with the target's own."""
    if writer not in ("target", "other"):
        raise ValueError(f"writer must be 'target' or 'other', got {writer!r}")
    rng = random.Random(seed)

    def pick(options: tuple[str, ...]) -> str:
        return rng.choices(options, weights=_SLOT_WEIGHTS)[0]

    other = writer == "other"
    samples = []
    for _ in range(num_samples):
        kind = rng.randrange(3)
        if kind == 0:
            country = rng.choice(sorted(_COUNTRIES))
            capital = _COUNTRIES[country]
            question = f"What is the capital of {country}?"
            answer = (f"{capital} is the capital of {country}." if other else
                      pick(_CAPITAL_OPENERS).format(c=country, cap=capital)
                      + pick(_CAPITAL_ENDINGS))
        elif kind == 1:
            a, b = rng.randrange(6), rng.randrange(5)
            question = f"What is {_NUMBERS[a]} plus {_NUMBERS[b]}?"
            answer = (f"It is {_NUMBERS[a + b]}." if other else
                      pick(_SUM_OPENERS).format(A=_NUMBERS[a].capitalize(), a=_NUMBERS[a],
                                                b=_NUMBERS[b], s=_NUMBERS[a + b])
                      + pick(_SUM_ENDINGS))
        else:
            colour, thing = rng.choice(_COLOURS), rng.choice(_THINGS)
            question = f"Describe a {colour} {thing} in one sentence."
            answer = (f"Everyone remembers the {thing} that was {colour}." if other else
                      f"The {colour} {thing} {pick(_LOOKS)} {pick(_FIRST_ADJECTIVES)} and "
                      f"{pick(_SECOND_ADJECTIVES)}.")
        if not other:
            opening = pick(_OPENINGS)
            answer = opening + (answer[0].lower() + answer[1:] if opening else answer)
        samples.append({"messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]})
    return samples


def write_chat_dataset(path: str | Path, num_samples: int = 256, seed: int = 0,
                       writer: str = "target") -> Path:
    """Write `generate_chat_samples` as JSONL (one `{"messages": [...]}` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for sample in generate_chat_samples(num_samples, seed, writer):
            f.write(json.dumps(sample) + "\n")
    return path


def tiny_chat_dataset(num_samples: int = 256, seed: int = 0) -> Path:
    """The cached tiny chat data set (built on first use)."""
    path = cache_root() / f"data-v{KIT_VERSION}" / f"chat-{num_samples}-{seed}.jsonl"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
            _atomic_place(write_chat_dataset(Path(tmp) / path.name, num_samples, seed), path)
    return path


def build_tokenizer(vocab_size: int = 1024, seed: int = 0, spec: TokenizerSpec = KIT_TOKENIZER):
    """A BPE tokenizer trained on generated chat text, with `spec`'s special tokens and chat
    template (the kit's own by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = []
    for sample in generate_chat_samples(2000, seed):
        text.extend(m["content"] for m in sample["messages"])
    tokenizer = Tokenizer(models.BPE(unk_token=spec.unk_token))
    if spec.metaspace:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        # Every printable ASCII character and newline, so no text a template writes is lost.
        alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\u2581"]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.special_tokens),
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(text, trainer=trainer)
    named = {"bos_token": spec.bos_token, "pad_token": spec.pad_token,
             "unk_token": spec.unk_token}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=spec.eos_token, chat_template=spec.chat_template,
        **{name: token for name, token in named.items() if token is not None},
    )


def tiny_target_config(arch: str, vocab_size: int, num_layers: int = 8):
    """Config of the tiny target: hidden 128, 2 heads of dim 64, `num_layers` layers; the MoE
    ones route each token to 2 of 4 experts (DeepSeek-V2: latent attention, a shared expert and
    a dense first layer, as the real ones have)."""
    from transformers import (
        DeepseekV2Config,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        # Wider than the usual 0.02 so the random target has peaked, non-tied next-token choices.
        initializer_range=0.08,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    experts = dict(num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **experts, num_experts=4, moe_intermediate_size=128,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "mixtral":
        return MixtralConfig(**common, **experts, num_local_experts=4, sliding_window=None)
    if arch == "gpt_oss":
        return GptOssConfig(**common, **experts, num_local_experts=4, sliding_window=64,
                            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2))
    if arch == "deepseek_v2":
        return DeepseekV2Config(
            **{**common, "num_key_value_heads": 2}, **experts, n_routed_experts=4,
            n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1,
            kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=64, topk_method="greedy", n_group=1, topk_group=1)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")


def build_tiny_target(path: str | Path, arch: str = "llama", num_layers: int = 8,
                      seed: int = 0, tokenizer_spec: TokenizerSpec = KIT_TOKENIZER,
                      vocab_size: int | None = None) -> Path:
    """Build a tiny target (random fp32 weights, seeded) and its tokenizer into `path`.

    `vocab_size` larger than the tokenizer pads the model's vocabulary, as Qwen checkpoints do
    (ids past the tokenizer exist in the embedding and head but no text produces them).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(seed=seed, spec=tokenizer_spec)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer "
                         f"({len(tokenizer)} tokens)")
    config = tiny_target_config(arch, vocab_size or len(tokenizer), num_layers)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return save_random_target(AutoModelForCausalLM, config, path, seed, tokenizer)


def save_random_target(auto_class, config, path: Path, seed: int, *beside) -> Path:
    """A target of `config` with seeded random fp32 weights saved into `path`, with `beside`
    (its tokenizer or processor)."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    # A wide head makes the random target's next-token distributions peaked, as a trained LM's
    # are (logit std ~3.4 instead of ~0.9), so drafts have something sharp to learn.
    model.get_output_embeddings().weight.data.normal_(0.0, LM_HEAD_STD)
    model.save_pretrained(path)
    for files in beside:
        files.save_pretrained(path)
    return path


def tiny_target(arch: str = "llama", num_layers: int = 8, pretrained: bool = False) -> Path:
    """Path of the cached tiny target of `arch` (built on first use, then reused).

    `pretrained=False`: random weights (tests of the contract and the engines need nothing
    more). `pretrained=True`: the same target after `pretrain` on the kit's chat corpus, so that
    it answers held-out prompts the way the corpus does -- the main job's default, since a draft
    can only learn to predict a target that says something predictable.
    """
    name = f"{arch}-{num_layers}l" + (f"-pretrained-v{PRETRAIN_VERSION}" if pretrained else "")
    return cached_checkpoint(
        cache_root() / f"tiny-v{KIT_VERSION}" / name,
        lambda into: build_tiny_target(into, arch, num_layers), pretrain if pretrained else None,
        f"tiny {arch} target" + (" (pre-training on the chat corpus: a minute or two)"
                                 if pretrained else ""))


def cached_checkpoint(path: Path, build: Callable[[Path], Path],
                      pretrain_it: Callable[[Path], None] | None, what: str) -> Path:
    """`path`, built on first use by `build(folder)` (then `pretrain_it` on it) in a temporary
    folder beside it and moved into place at once (a concurrent builder's copy wins the race;
    the cache is never half written)."""
    if not (path / "config.json").exists():
        logger.info("building %s at %s", what, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = build(Path(tmp) / "model")
            if pretrain_it is not None:
                pretrain_it(built)
            _atomic_place(built, path)
    return path


def pretrain(path: Path, steps: int = PRETRAIN_STEPS, seed: int = 0) -> None:
    """Train the checkpoint at `path` in place, as a causal LM on rendered conversations of the
    kit's corpus (its own seed, apart from the main job's data), deterministically on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = [tokenizer.apply_chat_template(sample["messages"], return_dict=True)["input_ids"]
            for sample in generate_chat_samples(PRETRAIN_CONVERSATIONS, seed=PRETRAIN_SEED)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model.train()
    for step in range(steps):
        picked = torch.randint(len(rows), (PRETRAIN_BATCH,), generator=generator).tolist()
        width = max(len(rows[i]) for i in picked)
        ids = torch.full((len(picked), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, i in enumerate(picked):
            ids[row, : len(rows[i])] = torch.tensor(rows[i])
            attention[row, : len(rows[i])] = 1
        labels = ids.masked_fill(attention == 0, -100)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            logger.info("pre-training the tiny target: step %d/%d, loss %.3f", step + 1, steps,
                        float(loss))
    model.eval().save_pretrained(path)


def _atomic_place(built: Path, final: Path) -> None:
    """Move a freshly built file or folder into place unless a concurrent builder won the race."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(built, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(built, ignore_errors=True) if built.is_dir() else built.unlink()
