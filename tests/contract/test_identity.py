"""What a target serves, and the check that stops a job from training for another target."""

import json
import shutil
import struct

import pytest

from eagle_ray.config import ConfigError, PoolConfig
from eagle_ray.contract.identity import TargetIdentity, check_job_target, checkpoint_fingerprint
from eagle_ray.tiny import build_tiny_target


@pytest.fixture(scope="module")
def served(hf_llama, llama_path):
    return TargetIdentity.of_backend(hf_llama, str(llama_path))


def test_identity_describes_the_backend(served, hf_llama, llama_path):
    assert served.model_path == str(llama_path)
    assert (served.num_hidden_layers, served.hidden_size, served.vocab_size) == (
        8, 128, hf_llama.vocab_size)
    assert served.aux_layer_ids == (1, 3, 4) and served.dtype == "float32"
    assert TargetIdentity.from_dict(served.to_dict()) == served


def test_a_copied_checkpoint_keeps_its_fingerprint(llama_path, tmp_path):
    copy = shutil.copytree(llama_path, tmp_path / "copy")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(llama_path)


def test_other_checkpoints_have_other_fingerprints(llama_path, qwen3_path, tmp_path):
    reseeded = build_tiny_target(tmp_path / "reseeded", "llama", seed=1)  # same config
    fingerprints = {checkpoint_fingerprint(p) for p in (llama_path, qwen3_path, reseeded)}
    assert len(fingerprints) == 3


def test_a_fine_tune_of_a_tensor_far_into_the_file_changes_the_fingerprint(llama_path, tmp_path):
    """Every tensor counts, not the first MiB of the file: the fingerprint of a copy whose last
    tensor (stored past the first MiB) was changed as a fine-tune changes it differs."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    copy = shutil.copytree(llama_path, tmp_path / "tuned")
    weights = copy / "model.safetensors"
    with open(weights, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    offsets = {n: t["data_offsets"][0] for n, t in header.items() if n != "__metadata__"}
    last = max(offsets, key=offsets.get)
    assert offsets[last] > 1 << 20, "the changed tensor lies past the first MiB"
    with safe_open(weights, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    tensors[last] = tensors[last] + 1e-3
    save_file(tensors, weights, metadata=metadata)
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(llama_path)


def test_a_job_that_leaves_settings_unset_adopts_the_pool(served):
    check_job_target(PoolConfig(), served)
    check_job_target(PoolConfig(model_path=served.model_path, aux_layer_ids=[1, 3, 4],
                                dtype="float32"), served)


@pytest.mark.parametrize(("setting", "message"), [
    ({"aux_layer_ids": [0, 2, 5]}, r"aux_layer_ids \[0, 2, 5\] differ from the pool's \[1, 3, 4\]"),
    ({"dtype": "bfloat16"}, "dtype bfloat16 differs from the pool's float32"),
])
def test_a_job_whose_settings_differ_is_stopped(served, setting, message):
    with pytest.raises(ConfigError, match=message):
        check_job_target(PoolConfig(**setting), served)


def test_a_job_naming_another_checkpoint_is_stopped(served, qwen3_path):
    with pytest.raises(ConfigError, match=rf"model_path {qwen3_path} is another checkpoint"):
        check_job_target(PoolConfig(model_path=str(qwen3_path)), served)
