"""`eagle-ray` command line: `train`, `eval`, `demo`, `serve`, `status`, `shutdown`, `bench`.

Results go to stdout (benchmarks: JSON lines); logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

logger = logging.getLogger("eagle_ray")

BENCHMARKS = ["encodings", "backends", "handoff", "engine-start", "pool", "router", "scaling",
              "transport", "train", "soak"]


def _demo(args: argparse.Namespace) -> int:
    """Build the tiny target, run a backend on a few chat samples, report supervision shapes."""
    import torch
    from transformers import AutoTokenizer

    from eagle_ray.chat import tokenize_conversation
    from eagle_ray.data import collate
    from eagle_ray.hf_target import HFEagle3TargetModel
    from eagle_ray.tiny import generate_chat_samples, tiny_target

    model_path = args.model or tiny_target(args.arch)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = [tokenize_conversation(tokenizer, s["messages"])
            for s in generate_chat_samples(args.samples, seed=1)]
    input_ids, attention_mask, loss_mask = collate(rows, pad_id=tokenizer.pad_token_id)
    target = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    batch = target.generate_batch(input_ids, attention_mask, loss_mask)
    logger.info("target %s: %d layers, aux layer ids %s (post-layer convention)",
                model_path, target.num_hidden_layers, target.aux_layer_ids)
    for name, tensor in batch.tensors().items():
        logger.info("  %-18s %-22s %s", name, str(list(tensor.shape)), tensor.dtype)
    tokens = int(attention_mask.sum())
    supervised = int(batch.loss_mask.sum())
    logger.info("%d tokens (%d supervised), %d bytes per token in the %s encoding", tokens,
                supervised, batch.nbytes // input_ids.numel(), batch.encoding)
    return 0


def _train(args: argparse.Namespace) -> int:
    """Train (and evaluate) an EAGLE-3 draft fed by the target pool."""
    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.train import run_job

    summary = run_job(load_yaml(JobConfig, args.config, args.overrides))
    print(json.dumps({"eval": summary.get("eval"), "draft_dir": summary["draft_dir"],
                      "final_metrics": summary["final_metrics"]}, default=str))
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Acceptance of an exported draft (simulated and vLLM-measured) on the job's held-out
    conversations, on the target the draft was exported for (or `target.model_path`)."""
    from transformers import AutoTokenizer

    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.data import load_conversations
    from eagle_ray.draft.export import exported_target
    from eagle_ray.evaluate import evaluate_draft

    job = load_yaml(JobConfig, args.config, args.overrides)
    model_path = job.target.model_path or exported_target(args.draft).model_path
    conversations = load_conversations(job.data.path, job.data.num_samples)
    held_out = [messages for _, messages in conversations[-job.data.eval_samples:]]
    report = evaluate_draft(model_path, args.draft, held_out,
                            AutoTokenizer.from_pretrained(model_path), job.eval)
    print(json.dumps(report))
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Start a detached, shared pool on a running cluster and wait until it is ready. The cluster
    must authenticate clients with a token (Ray's `RAY_AUTH_MODE=token`) unless
    --allow-insecure."""
    from eagle_ray.cluster import connect, require_authenticated_cluster
    from eagle_ray.config import PoolConfig, apply_overrides, from_dict, load_yaml
    from eagle_ray.pool import TargetPool

    if args.config:
        config = load_yaml(PoolConfig, args.config, args.overrides)
    else:
        config = from_dict(PoolConfig, apply_overrides({}, args.overrides))
    config.detached = True
    connect(args.address, config.namespace)
    require_authenticated_cluster(args.allow_insecure)
    pool = TargetPool.create(config)
    print(json.dumps(pool.status(), indent=2))
    logger.info("pool %r is serving in namespace %r; `eagle-ray status --name %s` shows it, "
                "`eagle-ray shutdown --name %s` removes it", config.name, config.namespace,
                config.name, config.name)
    return 0


def _status(args: argparse.Namespace) -> int:
    """Print a running pool's status as JSON: per replica state, load, tokens/s, restarts."""
    from eagle_ray.cluster import connect
    from eagle_ray.pool import TargetPool

    connect(args.address, args.namespace)
    print(json.dumps(TargetPool.connect(args.name, args.namespace).status(), indent=2))
    return 0


def _shutdown(args: argparse.Namespace) -> int:
    """Remove a running pool: kill its replicas and router, remove its placement groups."""
    from eagle_ray.cluster import connect
    from eagle_ray.pool import TargetPool

    connect(args.address, args.namespace)
    TargetPool.connect(args.name, args.namespace).shutdown()
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Run one benchmark; results are JSON lines on stdout, ratios measured in the same run."""
    import torch

    from eagle_ray.bench import backends, encodings, handoff, pool
    from eagle_ray.tiny import tiny_target

    which = args.which
    if which == "encodings":
        encodings.run()
    elif which == "handoff":
        handoff.run()
    elif which == "engine-start":
        backends.run_engine_start(str(tiny_target(args.arch)))
    elif which == "backends":
        from eagle_ray.hf_target import HFEagle3TargetModel
        from eagle_ray.supervision import DraftVocab
        from eagle_ray.vllm_target import VLLMEagle3TargetModel

        model_path = tiny_target(args.arch)
        hf = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
        half_vocab = DraftVocab.from_token_counts(torch.ones(hf.vocab_size), hf.vocab_size // 2)
        hf = HFEagle3TargetModel(hf.model, hf.aux_layer_ids, draft_vocab=half_vocab)
        backends.run_measured_bytes(hf)
        vllm = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32")
        backends.run_backends({"hf": hf, "vllm": vllm}, baseline="hf")
        vllm.shutdown()
    elif which == "pool":
        pool.run_overhead(str(tiny_target(args.arch)), [(8, 128), (16, 256), (8, 480)])
    elif which == "router":
        pool.run_router()
    elif which == "scaling":
        pool.run_scaling()
    elif which == "transport":
        pool.run_transport()
    elif which == "train":
        from eagle_ray.bench import train

        train.run(str(tiny_target(args.arch)))
    elif which == "soak":
        from eagle_ray.bench import soak

        soak.run(minutes=args.minutes)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, summary: str) -> argparse.ArgumentParser:
        """A subcommand whose `--help` shows its function's docstring."""
        p = sub.add_parser(name, help=summary, description=func.__doc__)
        p.set_defaults(func=func)
        return p

    def add_pool_target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        p.add_argument("--name", default="eagle_ray_pool", help="pool name")
        p.add_argument("--namespace", default="eagle_ray", help="Ray namespace of the pool")

    demo = command("demo", _demo, "supervision for a few chat samples from the tiny target")
    demo.add_argument("--model", help="target model folder (default: the tiny built-in target)")
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen3"],
                      help="tiny target architecture when --model is not given")
    demo.add_argument("--samples", type=int, default=4, help="chat samples in the micro-batch")

    train = command("train", _train, "train an EAGLE-3 draft on Ray Train fed by the pool")
    train.add_argument("--config", required=True, help="job config YAML (keys: see README)")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=50 target.replicas=2")

    evaluate = command("eval", _eval, "acceptance length of an exported draft")
    evaluate.add_argument("--config", required=True, help="the job config the draft came from")
    evaluate.add_argument("--draft", required=True, help="exported draft folder")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value",
                          help="config overrides, e.g. eval.prompts=16")

    serve = command("serve", _serve, "start a detached, shared pool on a running cluster")
    serve.add_argument("--config", help="pool config YAML (keys: see README)")
    serve.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    serve.add_argument("--allow-insecure", action="store_true",
                       help="serve on a cluster without token authentication")
    serve.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. replicas=2 vllm_kwargs.max_model_len=4096")

    add_pool_target(command("status", _status, "print a running pool's status (JSON)"))
    add_pool_target(command("shutdown", _shutdown, "remove a running pool"))

    bench = command("bench", _bench, "benchmarks; print JSON lines")
    bench.add_argument("which", choices=BENCHMARKS, help="which benchmark (see README)")
    bench.add_argument("--arch", default="llama", choices=["llama", "qwen3"],
                       help="tiny target architecture")
    bench.add_argument("--minutes", type=float, default=1.0,
                       help="soak: length of each phase (fault-free, then with faults)")
    return parser


def main(argv: list[str] | None = None) -> int:
    # stdout carries results (JSON lines); vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from eagle_ray.config import ConfigError

    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, PermissionError) as e:
        logger.error("%s", e, exc_info=args.verbose)
        return 2


if __name__ == "__main__":
    sys.exit(main())
