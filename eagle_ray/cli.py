"""`eagle-ray` command line: `train`, `plan`, `preflight`, `cache`, `regenerate`, `eval`, `demo`,
`serve`, `status`, `shutdown`, `bench`.

Results go to stdout (benchmarks: JSON lines); logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from eagle_ray.bench import BENCHMARKS

logger = logging.getLogger("eagle_ray")



def _demo(args: argparse.Namespace) -> int:
    """Build the tiny target, run a backend on a few chat samples, report supervision shapes."""
    import torch
    from transformers import AutoTokenizer

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.data.chat import tokenize_conversation
    from eagle_ray.data.micro_batches import collate
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


def _job_console(job, verbose: bool) -> Path:
    """Console for a job command: stage lines and bars here, the rest in
    `<output_dir>/job.log` (`eagle_ray.console`)."""
    from eagle_ray.console import setup_console

    log_file = Path(job.output_dir).resolve() / "job.log"
    setup_console(log_file, verbose)
    logger.info("logs of Ray, Ray Data, Ray Train and vLLM: %s%s", log_file,
                "" if verbose else " (--verbose shows them here)")
    return log_file


def _train(args: argparse.Namespace) -> int:
    """Train (and evaluate) an EAGLE-3 draft fed by the target pool; prints a summary table
    with the command that serves the draft (`summary.json` and `report.png` in output_dir)."""
    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.train.job import run_job
    from eagle_ray.train.report import format_summary

    job = load_yaml(JobConfig, args.config, args.overrides)
    log_file = _job_console(job, args.verbose)
    summary = run_job(job, log_to_driver=args.verbose)
    print(format_summary({**summary, "log_file": str(log_file)}), flush=True)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Per-GPU memory of a trainer worker (weights, optimizer, one training step measured at the
    recipe's shape on fake tensors) and of a replica (weights, KV cache), supervision bytes per
    token, and the trainer GPUs one replica feeds (estimated from FLOPs). Exit 2 when a trainer
    worker or a replica would not fit its GPU."""
    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.plan import check_job_fits, format_plan, plan_job, read_target_config

    job = load_yaml(JobConfig, args.config, args.overrides)
    target_config = read_target_config(job, args.target_config)
    plan = plan_job(job, target_config, gpu_memory_gib=args.gpu_memory_gib)
    print(json.dumps(plan.to_dict()) if args.json else format_plan(plan), flush=True)
    check_job_fits(job, plan, args.trainer_budget_gib)
    return 0


def _preflight(args: argparse.Namespace) -> int:
    """Check a running cluster against a job before submitting it: every node's Python and
    package pins against this environment's, eagle_ray installed as a package, the job's paths
    seen (and written) on every node, custom resources, /dev/shm. Exit 1 naming each problem."""
    from eagle_ray.cluster import connect
    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.preflight import preflight

    job = load_yaml(JobConfig, args.config, args.overrides)
    connect(args.address, job.target.namespace)
    problems = preflight(job)
    print("".join(f"- {p}\n" for p in problems) + (f"{len(problems)} problem(s): fix them "
          f"before `ray job submit`" if problems else "ready: every node can run this job"))
    return 1 if problems else 0


def _cache(args: argparse.Namespace) -> int:
    """Write the pool's supervision for the job's data to `data.supervision_cache` (sharded
    safetensors, an index, the target's fingerprint); `eagle-ray train` with the same key then
    reads it instead of starting a pool. Prints the cache's summary (JSON)."""
    from eagle_ray.config import JobConfig, load_yaml
    from eagle_ray.data.cache_job import run_cache

    job = load_yaml(JobConfig, args.config, args.overrides)
    _job_console(job, args.verbose)
    print(json.dumps(run_cache(job, log_to_driver=args.verbose)), flush=True)
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    """Replace the assistant turns of a chat JSONL with the target's own answers, generated by
    the job's pool (started for the run, or the shared one with use_shared_pool=true), turn by
    turn; a rerun resumes. Sampling keys (temperature, top_p, max_new_tokens, seed) may be
    given bare or as regenerate.<key>."""
    import dataclasses

    from eagle_ray.backends.base import Sampling
    from eagle_ray.config import JobConfig, RegenerateConfig, load_yaml
    from eagle_ray.data.regenerate import regenerate_file
    from eagle_ray.data.tokenizer_files import load_tokenizer
    from eagle_ray.driver import check_paths, init_ray, job_pool

    sampling_keys = {f.name for f in dataclasses.fields(RegenerateConfig)}
    overrides = [f"regenerate.{o}" if o.partition("=")[0] in sampling_keys else o
                 for o in args.overrides]
    job = load_yaml(JobConfig, args.config, overrides)
    _job_console(job, args.verbose)
    settings = job.regenerate
    check_paths(job)
    init_ray(job, log_to_driver=args.verbose)
    # The pool's engines are sized for regeneration's prompts and answers too.
    regenerating = dataclasses.replace(job, regenerate=dataclasses.replace(settings, enabled=True))
    with job_pool(regenerating) as (pool, served):
        _, tokenizer = load_tokenizer(
            job.target.model_path or served.model_path, job.target.vllm_kwargs,
            "eagle-ray regenerate (it renders the prompts and reads the answers)")
        report = regenerate_file(
            pool.client(), tokenizer, args.input, args.output,
            Sampling(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                     top_p=settings.top_p, seed=settings.seed),
            fingerprint=served.fingerprint,
            conversations_per_wave=settings.conversations_per_wave,
            prompts_per_request=settings.prompts_per_request)
    print(json.dumps({**dataclasses.asdict(report),
                      "changed_share": round(report.changed_share, 4)}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Acceptance of an exported draft (vLLM at each k and temperature, with intervals, and the
    greedy simulation) on `--prompts` (MT-Bench, GSM8K or chat JSONL) or the job's held-out
    conversations, on the target the draft was exported for (or `target.model_path`)."""
    from eagle_ray.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml
    from eagle_ray.data.ingest import held_out, read_chats
    from eagle_ray.draft.export import exported_target
    from eagle_ray.driver import draft_serving, init_ray
    from eagle_ray.evaluation.evaluate import evaluate_on_cluster, evaluation_prompts
    from eagle_ray.train.report import format_summary

    overrides = args.overrides + ([f"eval.prompts_file={args.prompts}"] if args.prompts else [])
    job = load_yaml(JobConfig, args.config, overrides) if args.config \
        else from_dict(JobConfig, apply_overrides({}, overrides))
    data = job.data  # its held-out conversations, unless the prompts come from a file
    if not job.eval.prompts_file and data.path is None and not args.kit_prompts:
        raise ConfigError("eagle-ray eval needs prompts: --prompts FILE (MT-Bench `turns`, "
                          "GSM8K `question` or chat JSONL; docs/training.md, \"Evaluation "
                          "prompts\"), or a --config whose data.path holds your chats (its "
                          "held-out ones are used); --kit-prompts scores on the tiny kit's "
                          "generated chats instead")
    _job_console(job, args.verbose)
    model_path = job.target.model_path or exported_target(args.draft).model_path
    init_ray(job, log_to_driver=args.verbose)
    conversations = [] if job.eval.prompts_file else held_out(
        read_chats(data.path, data.num_samples, data.cpus_per_task), data.eval_samples)
    serving = draft_serving(job, model_path, Path(args.draft))
    report = evaluate_on_cluster(job.target, serving, evaluation_prompts(job.eval, conversations),
                                 job.eval)
    print(format_summary({"eval": report, "draft_dir": args.draft,
                          "serve_command": serving.command(job.eval.num_speculative_tokens[0])}))
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
    """Print a running pool's status as JSON: per replica state, load, tokens/s, on-node share,
    restarts; with --watch, a compact table refreshed every few seconds until Ctrl-C."""
    from eagle_ray.cluster import connect
    from eagle_ray.pool import TargetPool
    from eagle_ray.pool.status_view import format_status

    connect(args.address, args.namespace)
    pool = TargetPool.connect(args.name, args.namespace)
    if args.watch is None:
        print(json.dumps(pool.status(), indent=2))
        return 0
    try:
        while True:
            table = format_status(args.name, pool.status())
            sys.stdout.write("\x1b[H\x1b[2J" + table + "\n")  # home, clear: redraw in place
            sys.stdout.flush()
            time.sleep(args.watch)
    except KeyboardInterrupt:
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
    from eagle_ray import bench
    from eagle_ray.tiny import tiny_target

    saved = bench.run(args.which, str(tiny_target(args.arch)), args)
    if saved is not None:
        logger.info("saved the results to %s", saved)
    return 0


JOB_CONFIG = "job config YAML (keys: docs/configuration.md)"
Command = Callable[[str, Callable[[argparse.Namespace], int], str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, summary: str) -> argparse.ArgumentParser:
        """A subcommand whose `--help` shows its function's docstring."""
        p = sub.add_parser(name, help=summary, description=func.__doc__)
        p.set_defaults(func=func)
        return p

    _add_job_commands(command)
    _add_pool_commands(command)
    return parser


def _add_job_commands(command: Command) -> None:
    """The commands around a training job: demo, train, plan, cache, regenerate, eval."""
    demo = command("demo", _demo, "supervision for a few chat samples from the tiny target")
    demo.add_argument("--model", help="target model folder (default: the tiny built-in target)")
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen3"],
                      help="tiny target architecture when --model is not given")
    demo.add_argument("--samples", type=int, default=4, help="chat samples in the micro-batch")

    train = command("train", _train, "train an EAGLE-3 draft on Ray Train fed by the pool")
    train.add_argument("--config", required=True, help=JOB_CONFIG)
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.steps=50 target.replicas=2")

    preflight = command("preflight", _preflight, "check a running cluster against a job")
    preflight.add_argument("--config", required=True, help=JOB_CONFIG)
    preflight.add_argument("--address", default="auto",
                           help="Ray cluster address (default: auto; RAY_ADDRESS works too)")
    preflight.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    plan = command("plan", _plan, "per-GPU memory and rates of a job, before it starts")
    plan.add_argument("--config", required=True, help=JOB_CONFIG)
    plan.add_argument("--target-config", help="the target's config.json or folder, when "
                      "target.model_path is not readable here (e.g. examples/targets/...)")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="plan for GPUs of this memory (GiB), whatever this machine has; "
                           "default: this machine's GPU, else train.gpu_memory_gib, else an "
                           "assumed 80")
    plan.add_argument("--trainer-budget-gib", type=float, default=None,
                      help="what a trainer worker may use; default: 80%% of the GPU")
    plan.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="config overrides, e.g. data.micro_batch_size=1")

    cache = command("cache", _cache, "write the pool's supervision for the job's data to disk")
    cache.add_argument("--config", required=True, help=JOB_CONFIG)
    cache.add_argument("overrides", nargs="*", metavar="key=value",
                       help="e.g. data.supervision_cache=runs/cache target.encoding_dtype=fp8")

    regenerate = command("regenerate", _regenerate,
                         "regenerate a chat dataset's answers with the target through the pool")
    regenerate.add_argument("--config", required=True, help="job config YAML (target, pool)")
    regenerate.add_argument("--input", required=True, help="chat JSONL (messages or ShareGPT)")
    regenerate.add_argument("--output", required=True, help="JSONL written (and resumed)")
    regenerate.add_argument("overrides", nargs="*", metavar="key=value",
                            help="e.g. temperature=0.7 max_new_tokens=512 target.replicas=2")

    evaluate = command("eval", _eval, "acceptance length of an exported draft")
    evaluate.add_argument("--config", help="the job config the draft came from (or defaults)")
    evaluate.add_argument("--draft", required=True, help="exported draft folder")
    evaluate.add_argument("--prompts", help="prompts JSONL: MT-Bench (turns), GSM8K (question) "
                          "or chat (messages / conversations); default: the held-out "
                          "conversations of --config's data.path")
    evaluate.add_argument("--kit-prompts", action="store_true",
                          help="without --prompts or data.path: score on the tiny kit's "
                               "generated chats (a smoke test, not a measurement)")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value",
                          help="config overrides, e.g. eval.prompts=16")


def _add_pool_commands(command: Command) -> None:
    """The commands around a running pool (serve, status, shutdown) and the benchmarks."""

    def add_pool_target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
        p.add_argument("--name", default="eagle_ray_pool", help="pool name")
        p.add_argument("--namespace", default="eagle_ray", help="Ray namespace of the pool")

    serve = command("serve", _serve, "start a detached, shared pool on a running cluster")
    serve.add_argument("--config", help="pool config YAML (keys: docs/configuration.md)")
    serve.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    serve.add_argument("--allow-insecure", action="store_true",
                       help="serve on a cluster without token authentication")
    serve.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. replicas=2 vllm_kwargs.max_model_len=4096")

    status = command("status", _status, "print a running pool's status (JSON, or --watch)")
    add_pool_target(status)
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                        metavar="SECONDS", help="refresh a compact table (every 2 s by default)")
    add_pool_target(command("shutdown", _shutdown, "remove a running pool"))

    bench = command("bench", _bench, "benchmarks; print JSON lines")
    bench.add_argument("which", choices=list(BENCHMARKS),
                       help="which benchmark (docs/benchmarks.md)")
    bench.add_argument("--arch", default="llama", choices=["llama", "qwen3"],
                       help="tiny target architecture")
    bench.add_argument("--minutes", type=float, default=1.0,
                       help="soak: length of each phase (fault-free, then with faults)")
    bench.add_argument("--conversations", type=int, nargs="+", default=[10_000, 100_000],
                       help="ingest: dataset sizes compared (driver memory must stay flat)")
    bench.add_argument("--device", default="cuda", help="gpu: the device measured (cuda, cpu)")
    bench.add_argument("--seed", type=int, default=0,
                       help="job: the seed every arm trains from (one saved run per seed)")
    bench.add_argument("--quick", action="store_true", help="the smallest sizes that run all of "
                       "its code (CI; gpu: tiny shapes instead of Llama-3.1-8B's)")
    bench.add_argument("--save", nargs="?", const="benchmarks/results", default=None,
                       metavar="DIR", help="keep the results as a file under DIR/<which>/")


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
