"""What a target serves, as one record: the link between the pool, the training job and the export.

A draft is only as good as the agreement between the target that produced its supervision and the
target that serves it: another checkpoint, other aux layer ids, or another vocabulary make vLLM
feed the draft inputs it never saw, and acceptance collapses with no error. So every replica
reports a `TargetIdentity`, a job checks it against its own target settings before training
(`check_job_target`), and the export writes it into the draft's config.

The checkpoint fingerprint hashes `config.json` (without fields that name the writer) and, per
safetensors file, its header (tensor names, dtypes, shapes) plus the first bytes of every tensor
(`TENSOR_SAMPLE_BYTES`): the same checkpoint copied elsewhere keeps its fingerprint; another
architecture, size or vocabulary does not, nor does a fine-tune of any tensor (training changes
every value of what it touches, the first ones too). A change confined to values past a tensor's
first bytes goes unseen. Reading it costs one small read per tensor, not a pass over the
weights (an 8B checkpoint: ~300 reads of 256 bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_ray.config.loader import ConfigError

if TYPE_CHECKING:
    from eagle_ray.backends.base import RunnerEagle3TargetModel
    from eagle_ray.config.pool import PoolConfig

TENSOR_SAMPLE_BYTES = 256
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")


@dataclasses.dataclass(frozen=True)
class TargetIdentity:
    """What a replica serves. `fingerprint` is empty for a backend without a checkpoint."""

    model_path: str
    fingerprint: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int  # the checkpoint's (padded) vocabulary: what logits, d2t and t2d index
    aux_layer_ids: tuple[int, ...]  # canonical (post-layer) ids
    encoding: str
    dtype: str
    max_length: int | None  # longest row the target accepts

    @classmethod
    def of_backend(cls, backend: RunnerEagle3TargetModel, model_path: str | None
                   ) -> TargetIdentity:
        has_checkpoint = model_path is not None and (Path(model_path) / "config.json").exists()
        return cls(
            model_path=str(model_path) if model_path else "",
            fingerprint=checkpoint_fingerprint(model_path) if has_checkpoint else "",
            num_hidden_layers=backend.num_hidden_layers,
            hidden_size=backend.get_input_embeddings().weight.shape[1],
            vocab_size=backend.vocab_size,
            aux_layer_ids=tuple(backend.aux_layer_ids),
            encoding=backend.encoding,
            dtype=str(backend.get_target_head().lm_head.weight.dtype).removeprefix("torch."),
            max_length=backend.max_length,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetIdentity:
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})

    def describe(self) -> str:
        return (f"{self.model_path or 'a checkpoint-less backend'} (fingerprint "
                f"{self.fingerprint[:12] or '-'}, {self.num_hidden_layers} layers, hidden "
                f"{self.hidden_size}, vocabulary {self.vocab_size}, aux layer ids "
                f"{list(self.aux_layer_ids)}, {self.dtype}, {self.encoding})")


def checkpoint_fingerprint(model_path: str | Path) -> str:
    """A short hash that tells checkpoints apart (see the module docstring)."""
    root = Path(model_path)
    config = json.loads((root / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for weights in sorted(root.glob("*.safetensors")):
        with open(weights, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            header = f.read(header_size)
            digest.update(header)
            tensors = json.loads(header)
            for name in sorted(n for n in tensors if n != "__metadata__"):
                start, end = tensors[name]["data_offsets"]
                f.seek(8 + header_size + start)
                digest.update(f.read(min(end - start, TENSOR_SAMPLE_BYTES)))
    return digest.hexdigest()[:32]


def check_job_target(target: PoolConfig, served: TargetIdentity, source: str | None = None
                     ) -> None:
    """Stop a job whose target settings disagree with what the pool serves (or what made its
    supervision, `source`: a supervision cache).

    Settings the job left unset (`model_path`, `aux_layer_ids` None, `dtype` "auto") adopt the
    pool's. The encoding is not compared: the trainer decodes every encoding the same way.
    """
    problems = []
    if target.model_path is not None:
        own = checkpoint_fingerprint(target.model_path) if (
            Path(target.model_path) / "config.json").exists() else ""
        if own != served.fingerprint:
            problems.append(f"target.model_path {target.model_path} is another checkpoint "
                            f"(fingerprint {own[:12] or '-'})")
    if target.aux_layer_ids is not None and tuple(target.aux_layer_ids) != served.aux_layer_ids:
        problems.append(f"target.aux_layer_ids {target.aux_layer_ids} differ from the pool's "
                        f"{list(served.aux_layer_ids)}")
    if target.dtype != "auto" and target.dtype != served.dtype:
        problems.append(f"target.dtype {target.dtype} differs from the pool's {served.dtype}")
    if problems:
        source = source or f"the pool {target.name!r}"
        raise ConfigError(
            f"{source} serves {served.describe()}, but " + "; ".join(problems)
            + f". A draft trained on this supervision would be exported for a target it was not "
            f"trained on. Make the job's target.* settings match {source} (or leave them unset "
            f"to adopt its target), or make the supervision with the job's settings.")
