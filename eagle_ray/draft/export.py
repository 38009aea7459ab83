"""Export a trained draft as the HF folder vLLM's EAGLE-3 loader reads, and check it (a
P-EAGLE draft is the same folder plus `mask_hidden`, its mask token and aux layer count).

vLLM validates almost none of this and fails silently (low acceptance) on a wrong layer id, a
missing `d2t` or a wrong `fc` width, so the export checks its own output against the target the
draft was trained on (`TargetIdentity`, recorded in `config.json` as `eagle_ray_target`) before
anyone serves it. A full-vocabulary draft (`draft_vocab_size` = the target's vocabulary) carries no
`d2t`/`t2d`: vLLM then maps draft ids to target ids one to one, and refuses a `d2t`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_ray.aux_layers import vllm_capture_layer_ids
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.peagle import PEagleDraft
from eagle_ray.identity import TargetIdentity
from eagle_ray.supervision import DraftVocab

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
TARGET_KEY = "eagle_ray_target"  # config.json: the TargetIdentity the draft was trained against
TTT_STEPS_KEY = "eagle_ray_ttt_steps"  # config.json: draft steps it was trained to chain
KIND_KEY = "eagle_ray_draft_kind"  # config.json: `DraftSpec.kind` (absent: eagle3)
MASK_TOKEN_KEY = "mask_token_id"  # config.json: where vLLM reads a parallel draft's mask token


def serving_layer_ids(target: TargetIdentity) -> list[int]:
    """The target's canonical aux ids in vLLM's pre-layer convention, without the final-state id
    `N` (only the capture needs it)."""
    return vllm_capture_layer_ids(target.aux_layer_ids, target.num_hidden_layers)[:-1]


def export_draft(draft: Eagle3Draft, vocab: DraftVocab, target: TargetIdentity,
                 out_dir: str | Path, ttt_steps: int | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `d2t`, `t2d` unless full-vocabulary) for the
    `target` the draft was trained against (and the `ttt_steps` it was trained to chain: the
    most draft tokens an evaluation asks of it), and validate them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = draft.config
    serving_ids = serving_layer_ids(target)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": serving_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": serving_ids,
                         "use_aux_hidden_state": True},
        TARGET_KEY: target.to_dict(),
        KIND_KEY: draft.kind,
        **({TTT_STEPS_KEY: ttt_steps} if ttt_steps is not None else {}),
        **_parallel_drafting_keys(draft),
    }
    state = {name: t.detach().cpu().contiguous() for name, t in draft.state_dict().items()
             if not name.startswith("embed_tokens.")}  # vLLM shares the target's embedding
    if vocab.size != target.vocab_size:
        state["d2t"] = vocab.d2t.clone()
        state["t2d"] = vocab.t2d.clone()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / WEIGHTS_FILE))
    validate_export(out, target)
    logger.info("exported draft to %s (aux ids %s in vLLM's convention)", out, serving_ids)
    return out


def validate_export(path: str | Path, target: TargetIdentity) -> None:
    """Raise ValueError on anything vLLM would load silently and serve badly for `target`."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / WEIGHTS_FILE))
    problems = []
    hidden, draft_vocab = config["hidden_size"], config["draft_vocab_size"]
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    full_vocabulary = draft_vocab == target.vocab_size
    layers = len(target.aux_layer_ids)
    expected = {
        "fc.weight": (hidden, layers * target.hidden_size),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (config["intermediate_size"], hidden),
        "midlayer.mlp.up_proj.weight": (config["intermediate_size"], hidden),
        "midlayer.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        **({} if full_vocabulary else {"d2t": (draft_vocab,)}),
        **{f"layers.{i}.{name}": shape for i in range(1, config["num_hidden_layers"])
           for name, shape in _plain_layer_shapes(config).items()},
        **({"mask_hidden": (1, layers * target.hidden_size)}
           if config.get(KIND_KEY) == "peagle" else {}),
    }
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"missing weight {name}")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"{name} has shape {list(weights[name].shape)}, expected {list(shape)}")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if ids != serving_layer_ids(target):
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} are not the layers the target "
                        f"was captured at: canonical {list(target.aux_layer_ids)} = "
                        f"{serving_layer_ids(target)} in vLLM's pre-layer convention")
    if config["vocab_size"] != target.vocab_size:
        problems.append(f"vocab_size {config['vocab_size']} is not the target's "
                        f"{target.vocab_size}")
    if draft_vocab > target.vocab_size:
        problems.append(f"draft_vocab_size {draft_vocab} exceeds the target's vocabulary")
    if config.get(KIND_KEY) == "peagle":
        problems += _parallel_drafting_problems(config, target)
    if full_vocabulary and "d2t" in weights:
        problems.append("a full-vocabulary draft carries d2t, which vLLM refuses to load")
    if "d2t" in weights and not full_vocabulary:
        d2t = weights["d2t"]
        if d2t.dtype != torch.int64:
            problems.append(f"d2t must be int64 offsets, got {d2t.dtype}")
        target_ids = torch.arange(d2t.numel()) + d2t
        if target_ids.min() < 0 or target_ids.max() >= target.vocab_size:
            problems.append("d2t maps draft ids outside the target vocabulary (offsets expected: "
                            "target_id = draft_id + d2t[draft_id])")
        if not torch.all(target_ids[1:] > target_ids[:-1]):
            problems.append("d2t does not map to distinct ascending target ids")
    if problems:
        raise ValueError(f"draft export {path} is not servable: " + "; ".join(problems))


def _plain_layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """A layer after the first: a Llama layer reading H (vLLM's `layers.i`, i >= 1)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q, kv = (config["num_attention_heads"] * config["head_dim"],
             config["num_key_value_heads"] * config["head_dim"])
    return {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
            "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner), "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,)}


def _parallel_drafting_keys(draft: Eagle3Draft) -> dict:
    """What vLLM reads to draft in parallel: the mask token and the aux layer count that sizes
    `mask_hidden` (without it vLLM assumes three: docs/training.md, "Draft kinds")."""
    if draft.kind != "peagle":
        return {}
    return {MASK_TOKEN_KEY: draft.mask_token_id,
            "num_aux_hidden_states": draft.config.num_aux_layers}


def _parallel_drafting_problems(config: dict, target: TargetIdentity) -> list[str]:
    mask = config.get(MASK_TOKEN_KEY)
    problems = []
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        problems.append(f"{MASK_TOKEN_KEY} {mask!r} is not a token id of the target's "
                        f"vocabulary [0, {target.vocab_size})")
    if config.get("num_aux_hidden_states") != len(target.aux_layer_ids):
        problems.append(f"num_aux_hidden_states {config.get('num_aux_hidden_states')!r} is not "
                        f"the {len(target.aux_layer_ids)} aux layers the target was captured at")
    return problems


def exported_kind(path: str | Path) -> str:
    """The kind of an exported draft (`DraftSpec.kind`; drafts exported before kinds existed
    are EAGLE-3)."""
    return json.loads((Path(path) / "config.json").read_text()).get(KIND_KEY, "eagle3")


def exported_target(path: str | Path) -> TargetIdentity:
    """The target an exported draft was trained against (`config.json`'s `eagle_ray_target`)."""
    config = json.loads((Path(path) / "config.json").read_text())
    if TARGET_KEY not in config:
        raise ValueError(f"{path} has no {TARGET_KEY} in config.json: not exported by eagle_ray")
    return TargetIdentity.from_dict(config[TARGET_KEY])


def exported_ttt_steps(path: str | Path) -> int | None:
    """How many draft steps an exported draft was trained to chain (None: not recorded)."""
    return json.loads((Path(path) / "config.json").read_text()).get(TTT_STEPS_KEY)


def load_exported_draft(path: str | Path, embedding_weight: torch.Tensor
                        ) -> tuple[Eagle3Draft, DraftVocab]:
    """Rebuild an exported draft (for evaluation) with the target's embedding."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    draft_config = DraftConfig(
        hidden_size=config["hidden_size"], target_hidden_size=config["target_hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        num_layers=config.get("num_hidden_layers", 1))
    weights = load_file(str(path / WEIGHTS_FILE))
    d2t = weights.pop("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.int64))
    weights.pop("t2d", None)
    if config.get(KIND_KEY) == "peagle":
        draft = PEagleDraft(draft_config, config[MASK_TOKEN_KEY], embedding_weight)
    else:
        draft = Eagle3Draft(draft_config, embedding_weight)
    draft.load_state_dict({**weights, "embed_tokens.weight": embedding_weight})
    vocab = DraftVocab(torch.arange(d2t.numel()) + d2t, config["vocab_size"])
    return draft, vocab
