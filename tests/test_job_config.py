"""Job configs: schema errors are clear; the shipped examples and cluster.yaml validate."""

from pathlib import Path

import pytest
import yaml

from eagle_ray.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml, to_dict
from eagle_ray.driver import check_paths
from eagle_ray.resources import Capacity, job_demands, never_fit

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["tiny.yaml", "llama3.1-8b.yaml", "llama3.1-8b-colocated.yaml",
                                  "llama3.1-8b-smoke.yaml", "qwen3-8b.yaml", "qwen3-30b-a3b.yaml",
                                  "llama3.1-8b-peagle.yaml", "tiny-peagle.yaml",
                                  "llama3.1-8b-dflash.yaml", "tiny-dflash.yaml"])
def test_example_configs_load(name):
    config = load_yaml(JobConfig, ROOT / "examples" / name)
    assert config.train.workers >= 1


def test_unknown_key_names_the_path_and_the_allowed_keys():
    with pytest.raises(ConfigError, match=r"unknown key train\.stpes; allowed keys under train: "
                                          r".*steps"):
        from_dict(JobConfig, {"train": {"stpes": 10}})


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"train\.steps must be int, got 'ten'"):
        from_dict(JobConfig, {"train": {"steps": "ten"}})
    with pytest.raises(ConfigError, match=r"target\.encoding must be one of"):
        from_dict(JobConfig, {"target": {"encoding": "probs"}})


@pytest.mark.parametrize(("vllm_kwargs", "tp_size", "words"), [
    ({"enable_prefix_caching": True}, 1, "enable_prefix_caching=True: a cached prefix"),
    ({"distributed_executor_backend": "ray"}, 2, "distributed_executor_backend='ray'"),
    ({"kv_transfer_config": {}}, 1, "may not set"),
])
def test_engine_arguments_the_capture_cannot_take_fail_as_the_config_loads(vllm_kwargs, tp_size,
                                                                          words):
    with pytest.raises(ConfigError, match=f"target.vllm_kwargs {words}"):
        from_dict(JobConfig, {"target": {"vllm_kwargs": vllm_kwargs, "tp_size": tp_size}})
    # The control: the same keys are fine where the capture does not meet them.
    from_dict(JobConfig, {"target": {"vllm_kwargs": {"enable_prefix_caching": False,
                                                     "distributed_executor_backend": "ray"}}})


def test_each_engine_checks_its_own_settings_as_the_config_loads():
    """The check lives with the engine (`backends/engines.py`): the HF backend runs on one
    device, vLLM takes tensor parallelism; an unknown backend names the engines there are."""
    with pytest.raises(ConfigError, match="target.tp_size=2: the hf backend runs a target on one"):
        from_dict(JobConfig, {"target": {"backend": "hf", "tp_size": 2}})
    from_dict(JobConfig, {"target": {"backend": "vllm", "tp_size": 2}})  # the control
    with pytest.raises(ConfigError, match=r"backend must be one of \['hf', 'vllm'\] or"):
        from_dict(JobConfig, {"target": {"backend": "sglang"}})
    from_dict(JobConfig, {"target": {"backend": "my_package.engines:build"}})  # a factory


def test_missing_model_path_is_a_clear_error(tmp_path):
    config = from_dict(JobConfig, {"target": {"model_path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="is not a model folder"):
        check_paths(config)
    # The driver reads the data itself only to regenerate its answers (else Ray Data's readers
    # do, and `check_data_on_the_cluster` asks them: test_preflight.py).
    config = from_dict(JobConfig, {"data": {"path": str(tmp_path / "missing.jsonl")},
                                   "regenerate": {"enabled": True}})
    with pytest.raises(ConfigError, match="data.path .* does not exist here; the driver reads"):
        check_paths(config)


def test_a_job_on_a_weights_only_checkpoint_names_the_missing_tokenizer(tmp_path, llama_path):
    """Serving needs no tokenizer, the job's chat rendering does: refused before anything
    starts, naming the files and the key; a tokenizer kept elsewhere passes."""
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((llama_path / name).read_bytes())
    config = from_dict(JobConfig, {"target": {"model_path": str(weights_only)}})
    with pytest.raises(ConfigError, match=r"no tokenizer files \(none of tokenizer.json.*"
                                          r"target.vllm_kwargs.tokenizer"):
        check_paths(config)
    check_paths(from_dict(JobConfig, {"target": {"model_path": str(weights_only),
                                                 "vllm_kwargs": {"tokenizer": str(llama_path)}}}))


def test_overrides_apply_dotted_paths_with_yaml_values():
    data = apply_overrides({"train": {"steps": 5}}, ["train.steps=50", "target.replicas=2",
                                                     "target.vllm_kwargs.max_model_len=4096"])
    config = from_dict(JobConfig, data)
    assert config.train.steps == 50 and config.target.replicas == 2
    assert config.target.vllm_kwargs == {"max_model_len": 4096}
    with pytest.raises(ConfigError, match="not of the form key=value"):
        apply_overrides({}, ["train.steps"])


def test_cluster_yaml_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    broken = {**config, "max_wokers": 3}
    with pytest.raises(Exception, match="max_wokers"):
        validate_config(prepare_config(broken))


def test_cluster_yaml_keeps_token_authentication_on():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in config[key] if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_AUTH_MODE=token ray start") for c in starts)


def test_cluster_yaml_mounts_the_shared_storage_and_fails_loudly():
    """Every node mounts /mnt/shared (the recipes' paths) before it installs eagle_ray, no setup
    step hides its failure, and nodes get no test tools."""
    setup = yaml.safe_load((ROOT / "cluster.yaml").read_text())["setup_commands"]
    assert "mount" in setup[0] and "/mnt/shared" in setup[0]
    assert not [c for c in setup if "|| true" in c]
    install = next(c for c in setup if "setup_env.sh" in c)
    assert "EAGLE_RAY_EXTRAS=trackers" in install and "dev" not in install


def test_the_colocated_plan_puts_replicas_and_their_trainers_on_every_node():
    """The locality plan (docs/architecture.md, "Locality") places by resources alone: each
    cluster.yaml gpu_colocated node has room for a fixed number of the recipe's replicas and the
    trainers they feed, and the recipe asks for whole nodes, so every trainer has replicas on
    its own node."""
    config = load_yaml(JobConfig, ROOT / "examples" / "llama3.1-8b-colocated.yaml")
    node = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"][
        "gpu_colocated"]
    demands = job_demands(config)
    replica = next(d.resources for d in demands if d.what.startswith("target replica"))
    trainer = next(d.resources for d in demands if d.what.startswith("trainer worker"))
    resources = node["resources"]
    replicas_per_node = resources["target_gpu"] / replica["target_gpu"]
    nodes = config.target.replicas / replicas_per_node
    assert nodes == int(nodes) <= node["max_workers"], "whole nodes of replicas"
    per_node = resources["trainer_gpu"] / trainer["trainer_gpu"]
    assert config.train.workers == per_node * nodes, "whole nodes of trainers"
    assert replicas_per_node * replica["GPU"] + per_node * trainer["GPU"] == resources["GPU"], \
        "every GPU used"
    assert not never_fit(demands, Capacity([], {}, [(resources, node["max_workers"])]))


def test_a_resume_may_change_how_a_run_runs_but_not_what_its_draft_learns():
    """`run_record.settings_changed`: what a rerun under the same run_name would be refused for."""
    from eagle_ray.train.run_record import draft_settings, settings_changed

    example = ROOT / "examples" / "tiny.yaml"
    record = {"draft_settings": draft_settings(load_yaml(JobConfig, example))}
    assert "train.seed" in record["draft_settings"]
    assert not any(k.startswith(("target.runtime_env", "output_dir", "eval"))
                   for k in record["draft_settings"]), "only what shapes the draft is written"
    operational = load_yaml(JobConfig, example, [
        "train.steps=400", "train.workers=4", "eval.prompts=64", "target.replicas=3",
        "target.backend=hf", "target.model_path=/elsewhere", "output_dir=/elsewhere",
        "target.vllm_kwargs={max_num_seqs: 8}", "data.tokenize_workers=4"])
    assert settings_changed(record, operational) == []
    learning = load_yaml(JobConfig, example, [
        "train.seed=1", "target.encoding_dtype=fp8", "data.max_length=512",
        "regenerate.temperature=0.7"])
    assert settings_changed(record, learning) == [
        "data.max_length: 256 -> 512", "regenerate.temperature: 0.0 -> 0.7",
        "target.encoding_dtype: 'auto' -> 'fp8'", "train.seed: 0 -> 1"]
    # A key a later version added (absent from an older record) is no change.
    del record["draft_settings"]["train.seed"]
    assert settings_changed(record, learning)[-1] == "target.encoding_dtype: 'auto' -> 'fp8'"


def test_capture_ids_outside_a_moe_targets_layers_are_refused_before_anything_starts(
        family_checkpoints):
    path = str(family_checkpoints["qwen3_moe"])  # 8 layers
    with pytest.raises(ConfigError, match=r"target.aux_layer_ids \[1, 3, 9\]: .*8"):
        check_paths(from_dict(JobConfig, {"target": {"model_path": path,
                                                     "aux_layer_ids": [1, 3, 9]}}))
    check_paths(from_dict(JobConfig, {"target": {"model_path": path,
                                                 "aux_layer_ids": [1, 3, 5]}}))  # control


def test_an_eagle3_draft_reads_three_layers_and_the_others_any_number(family_checkpoints):
    path = str(family_checkpoints["qwen3_moe"])  # 8 layers
    five = {"model_path": path, "aux_layer_ids": [1, 2, 3, 4, 5]}
    with pytest.raises(ConfigError, match="EAGLE-3 needs exactly 3"):
        check_paths(from_dict(JobConfig, {"target": five}))
    for kind in ("peagle", "dflash"):
        check_paths(from_dict(JobConfig, {"target": five, "draft": {"kind": kind}}))


@pytest.mark.parametrize(("draft", "message"), [
    ({"kind": "medusa"}, "draft.kind"), ({"anchors_per_row": 0}, "draft.anchors_per_row"),
    ({"loss_decay_gamma": -1.0}, "draft.loss_decay_gamma"), ({"num_layers": 0}, "num_layers"),
    ({"loss_weighting": "exp"}, r"draft.loss_weighting must be one of \['decay', 'dpace'\]"),
    ({"loss_weighting": "dpace"}, "dpace weights DFlash's block slots.*draft.kind: dflash"),
    ({"kind": "dflash", "loss_weighting": "dpace", "loss_decay_gamma": 4.0},
     "draft.loss_decay_gamma is the decay's"),
    ({"kind": "dflash", "dpace_alpha": 0.0}, r"draft.dpace_alpha must be in \(0, 1\]")])
def test_draft_settings_are_checked_as_the_config_loads(draft, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(JobConfig, {"draft": draft})


@pytest.mark.parametrize(("train", "message"), [
    ({"loss": "kl"}, r"train.loss must be one of \['forward_kl', 'reverse_kl'"),
    ({"loss_params": {"eta": 3}}, "unknown key train.loss_params.*lk_eta"),
    ({"loss": "lk_hybrid", "lk_eta": -0.5}, "train.lk_eta must be a finite number >= 0"),
    ({"optimizer": "lion"}, r"train.optimizer must be one of \['adamw', 'muon'\]"),
    ({"muon_momentum": 1.0}, r"train.muon_momentum must be in \[0, 1\)"),
    ({"muon_ns_steps": 0}, r"train.muon_ns_steps must be in \[1, 100\)"),
    ({"muon_lr": 0.0}, "train.muon_lr must be > 0, or null"),
    ({"muon_weight_decay": -0.1}, "train.muon_weight_decay must be >= 0"),
    ({"muon_adjust_lr": "moonshot"}, "train.muon_adjust_lr must be one of")])
def test_loss_and_optimizer_settings_are_checked_as_the_config_loads(train, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(JobConfig, {"train": train})
    # The controls: the defaults, and each choice spelled right, load.
    config = from_dict(JobConfig, {"train": {"loss": "lk_hybrid", "lk_eta": 1.0,
                                             "optimizer": "muon", "muon_lr": 0.02},
                                   "draft": {"kind": "dflash", "loss_weighting": "dpace"}})
    assert (config.train.loss, config.train.optimizer, config.draft.loss_weighting) == (
        "lk_hybrid", "muon", "dpace")
    assert (from_dict(JobConfig, {}).train.loss, from_dict(JobConfig, {}).train.optimizer) == (
        "forward_kl", "adamw")


def test_the_configs_loss_names_are_the_losses_module():
    """`config` imports nothing of the contract: its Literal repeats the names, checked here."""
    import typing

    from eagle_ray.config.job import TrainConfig
    from eagle_ray.contract.losses import LOSSES

    assert typing.get_args(typing.get_type_hints(TrainConfig)["loss"]) == tuple(LOSSES)


def test_epochs_replace_steps_and_a_regeneration_may_be_as_long_as_a_row():
    config = from_dict(JobConfig, {"train": {"epochs": 2.5}, "data": {"max_length": 4096},
                                   "regenerate": {"max_new_tokens": None}})
    assert config.train.steps is None and config.train.epochs == 2.5  # the job derives them
    assert config.regenerate.max_new_tokens == 4096
    assert from_dict(JobConfig, {}).train.steps == 200
    with pytest.raises(ConfigError, match=r"train.steps \(10\) and train.epochs \(1.0\) both set"):
        from_dict(JobConfig, {"train": {"steps": 10, "epochs": 1}})


def test_steps_from_epochs_are_the_packed_micro_batches_times_the_epochs():
    from eagle_ray.train.job import with_steps_from_epochs

    config = from_dict(JobConfig, {"train": {"epochs": 2.5}})
    resolved = with_steps_from_epochs(config, micro_batches_per_epoch=41.2)
    assert resolved.train.steps == 103 and resolved.train.epochs is None
    # What the workers receive loads again (steps alone).
    assert from_dict(JobConfig, to_dict(resolved)).train.steps == 103
