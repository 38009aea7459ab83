"""Export a trained draft as the HF folder vLLM's loader for its kind reads, and check it (a
P-EAGLE draft is EAGLE-3's folder plus `mask_hidden`, its mask token and aux layer count; a
DFlash draft is a `DFlashDraftModel` with `dflash_config`).

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
from torch import nn

from eagle_ray.contract.aux_layers import vllm_capture_layer_ids
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.draft.kinds import build_draft
from eagle_ray.draft.model import DraftConfig

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
TARGET_KEY = "eagle_ray_target"  # config.json: the TargetIdentity the draft was trained against
TTT_STEPS_KEY = "eagle_ray_ttt_steps"  # config.json: draft steps it was trained to chain
KIND_KEY = "eagle_ray_draft_kind"  # config.json: `DraftSpec.kind` (absent: eagle3)
MASK_TOKEN_KEY = "mask_token_id"  # config.json: where vLLM reads a parallel draft's mask token
DFLASH_KEY = "dflash_config"  # config.json: a DFlash draft's mask token and target layers


def serving_layer_ids(target: TargetIdentity) -> list[int]:
    """The target's canonical aux ids in vLLM's pre-layer convention, without the final-state id
    `N` (only the capture needs it)."""
    return vllm_capture_layer_ids(target.aux_layer_ids, target.num_hidden_layers)[:-1]


def export_draft(draft: nn.Module, vocab: DraftVocab, target: TargetIdentity,
                 out_dir: str | Path, ttt_steps: int | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (+ `d2t`, `t2d` unless full-vocabulary) for the
    `target` the draft was trained against (and the `ttt_steps` it was trained to chain: the
    most draft tokens an evaluation asks of it), and validate them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = draft.config
    config = {
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
        TARGET_KEY: target.to_dict(),
        KIND_KEY: draft.kind,
        **({TTT_STEPS_KEY: ttt_steps} if ttt_steps is not None else {}),
        **_kind_keys(draft, target, ttt_steps),
    }
    state = {name: t.detach().cpu().contiguous() for name, t in draft.state_dict().items()
             if not name.startswith("embed_tokens.")}  # vLLM shares the target's embedding
    if vocab.size != target.vocab_size:
        state["d2t"] = vocab.d2t.clone()
        state["t2d"] = vocab.t2d.clone()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / WEIGHTS_FILE))
    validate_export(out, target)
    logger.info("exported %s draft to %s (aux ids %s in vLLM's convention)", draft.kind, out,
                serving_layer_ids(target))
    return out


def validate_export(path: str | Path, target: TargetIdentity) -> None:
    """Raise ValueError on anything vLLM would load silently and serve badly for `target`."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / WEIGHTS_FILE))
    problems = []
    draft_vocab = config["draft_vocab_size"]
    full_vocabulary = draft_vocab == target.vocab_size
    for name, shape in _expected_weights(config, target).items():
        if name not in weights:
            problems.append(f"missing weight {name}")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"{name} has shape {list(weights[name].shape)}, expected {list(shape)}")
    problems += _layer_id_problems(config, target)
    if config["vocab_size"] != target.vocab_size:
        problems.append(f"vocab_size {config['vocab_size']} is not the target's "
                        f"{target.vocab_size}")
    if draft_vocab > target.vocab_size:
        problems.append(f"draft_vocab_size {draft_vocab} exceeds the target's vocabulary")
    problems += _mask_token_problems(config, target)
    if "mask_hidden" in weights and config.get(KIND_KEY) == "dflash":
        problems.append("a DFlash draft carries mask_hidden, which vLLM refuses (its masked "
                        "slots read the mask token's embedding)")
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


def _kind_keys(draft: nn.Module, target: TargetIdentity, ttt_steps: int | None) -> dict:
    """What vLLM's loader for the draft's kind reads: EAGLE-3's architecture and aux ids
    (P-EAGLE adds its mask token and the aux layer count that sizes `mask_hidden`: without it
    vLLM assumes three); DFlash's architecture and `dflash_config` (canonical ids: vLLM adds 1,
    docs/contract.md), whose block size its proposer does not read (k is the serve command's)."""
    if draft.kind == "dflash":
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                "attention_bias": False,
                DFLASH_KEY: {MASK_TOKEN_KEY: draft.mask_token_id,
                             "target_layer_ids": list(target.aux_layer_ids)},
                **({"block_size": ttt_steps + 1} if ttt_steps is not None else {})}
    ids = serving_layer_ids(target)
    keys = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids,
                             "use_aux_hidden_state": True}}
    if draft.kind == "peagle":
        keys |= {MASK_TOKEN_KEY: draft.mask_token_id,
                 "num_aux_hidden_states": draft.config.num_aux_layers}
    return keys


def _expected_weights(config: dict, target: TargetIdentity) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM loads for the draft's kind, with its shape."""
    hidden, kind = config["hidden_size"], config.get(KIND_KEY, "eagle3")
    features = len(target.aux_layer_ids) * target.hidden_size
    common = {"fc.weight": (hidden, features), "norm.weight": (hidden,),
              "lm_head.weight": (config["draft_vocab_size"], hidden),
              **({} if config["draft_vocab_size"] == target.vocab_size
                 else {"d2t": (config["draft_vocab_size"],)})}
    layers = range(config["num_hidden_layers"])
    if kind == "dflash":
        head_dim = (config["head_dim"],)
        return {**common, "hidden_norm.weight": (hidden,),
                **{f"layers.{i}.{name}": shape for i in layers for name, shape in
                   {**_plain_layer_shapes(config), "self_attn.q_norm.weight": head_dim,
                    "self_attn.k_norm.weight": head_dim}.items()}}
    fused = {name: (shape[0], 2 * hidden) if name.endswith(("q_proj.weight", "k_proj.weight",
                                                            "v_proj.weight")) else shape
             for name, shape in _plain_layer_shapes(config).items()}
    return {**common, **{f"midlayer.{name}": shape for name, shape in fused.items()},
            "midlayer.hidden_norm.weight": (hidden,),
            **{f"layers.{i}.{name}": shape for i in layers[1:]
               for name, shape in _plain_layer_shapes(config).items()},
            **({"mask_hidden": (1, features)} if kind == "peagle" else {})}


def _layer_id_problems(config: dict, target: TargetIdentity) -> list[str]:
    canonical = list(target.aux_layer_ids)
    if config.get(KIND_KEY) == "dflash":
        ids = (config.get(DFLASH_KEY) or {}).get("target_layer_ids")
        overriding = [key for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config")
                      if key in config]
        return ([f"{DFLASH_KEY}.target_layer_ids {ids} are not the layers the target was "
                 f"captured at ({canonical}, canonical as DFlash's)"] if ids != canonical else []
                ) + [f"{key} would override dflash_config's layers in vLLM" for key in overriding]
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if ids == serving_layer_ids(target):
        return []
    return [f"eagle_aux_hidden_state_layer_ids {ids} are not the layers the target was captured "
            f"at: canonical {canonical} = {serving_layer_ids(target)} in vLLM's pre-layer "
            f"convention"]


def _mask_token_problems(config: dict, target: TargetIdentity) -> list[str]:
    kind = config.get(KIND_KEY, "eagle3")
    if kind == "eagle3":
        return []
    mask = exported_mask_token(config)
    problems = []
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        problems.append(f"{MASK_TOKEN_KEY} {mask!r} is not a token id of the target's "
                        f"vocabulary [0, {target.vocab_size})")
    if kind == "peagle" and config.get("num_aux_hidden_states") != len(target.aux_layer_ids):
        problems.append(f"num_aux_hidden_states {config.get('num_aux_hidden_states')!r} is not "
                        f"the {len(target.aux_layer_ids)} aux layers the target was captured at")
    return problems


def exported_mask_token(config: dict) -> int | None:
    """The mask token vLLM reads from a draft's `config.json` (DFlash's `dflash_config` first,
    as vLLM looks it up)."""
    return (config.get(DFLASH_KEY) or {}).get(MASK_TOKEN_KEY, config.get(MASK_TOKEN_KEY))


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
                        ) -> tuple[nn.Module, DraftVocab]:
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
        num_layers=config.get("num_hidden_layers", 1),
        num_aux_layers=len(exported_target(path).aux_layer_ids))
    weights = load_file(str(path / WEIGHTS_FILE))
    d2t = weights.pop("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.int64))
    weights.pop("t2d", None)
    draft = build_draft(config.get(KIND_KEY, "eagle3"), draft_config, embedding_weight,
                        exported_mask_token(config))
    draft.load_state_dict({**weights, "embed_tokens.weight": embedding_weight})
    vocab = DraftVocab(torch.arange(d2t.numel()) + d2t, config["vocab_size"])
    return draft, vocab
