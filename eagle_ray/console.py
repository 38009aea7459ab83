"""What a person sees: one line per stage and progress bars on the console; everything else
(Ray, Ray Data, vLLM, transformers) in a log file in the output folder.

`setup_console(log_file, verbose)` gives the console eagle_ray's own INFO lines (and any
library's errors) and sends every record to `log_file`; `--verbose` puts everything back on the
console. The Ray workers' output (replicas' engines, Ray Train's workers and controller) is not
forwarded to the driver unless verbose (`log_to_driver`); it stays in Ray's session logs
(`/tmp/ray/session_latest/logs` on each node; on one machine vLLM also writes to the log
file). The training bar runs on the driver, fed by the rank-0 worker through a `ProgressBoard`
actor, because worker output is not forwarded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

logger = logging.getLogger(__name__)

CONSOLE_FORMAT = "%(asctime)s %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s [pid %(process)d]: %(message)s"
# Libraries that configure their own handlers; routed to the file like everything else.
OWN_HANDLERS = ("ray", "ray.data", "ray.train", "ray.tune")
_quiet_log_file: Path | None = None  # set by setup_console when not verbose


class _OwnOrSerious(logging.Filter):
    """eagle_ray's records at INFO and above, anybody's at ERROR and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("eagle_ray") or record.levelno >= logging.ERROR


def setup_console(log_file: str | Path | None, verbose: bool) -> None:
    """Route logging as the module doc says (`log_file` None: console only, as before a job
    knows its output folder)."""
    global _quiet_log_file
    _quiet_log_file = None if verbose or log_file is None else Path(log_file)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT if not verbose else FILE_FORMAT,
                                           datefmt="%H:%M:%S"))
    if not verbose:
        console.addFilter(_OwnOrSerious())
    root.addHandler(console)
    handlers: list[logging.Handler] = [console]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, mode="a")
        file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(file_handler)
        handlers.append(file_handler)
        route_vllm_logs(Path(log_file), verbose)
    # Ray Data and Ray Train set up their loggers when imported: import them first, then
    # re-route; Python warnings (deprecations from libraries) go to the log as well.
    import ray.data  # noqa: F401
    import ray.train  # noqa: F401

    logging.captureWarnings(True)
    if not verbose:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars
    for name in OWN_HANDLERS:
        library = logging.getLogger(name)
        library.handlers = [h for h in handlers if h is not console or verbose]
        library.propagate = False
        if not verbose:
            # Their errors still reach the console.
            serious = logging.StreamHandler(sys.stderr)
            serious.setLevel(logging.ERROR)
            library.addHandler(serious)


def route_vllm_logs(log_file: Path, verbose: bool) -> None:
    """vLLM configures its loggers itself when imported, in every process it starts (engine
    cores included): give it a logging config that writes to `log_file` (and the console when
    verbose). Takes effect for vLLM imported after this call."""
    handlers = {"file": {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
                         "formatter": "plain"}}
    if verbose:
        handlers["console"] = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                               "formatter": "plain"}
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": FILE_FORMAT}},
              "handlers": handlers,
              "loggers": {"vllm": {"handlers": list(handlers), "level": "DEBUG" if verbose
                                   else "INFO", "propagate": False}}}
    path = log_file.with_name("vllm_logging.json")
    path.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)


@contextlib.contextmanager
def native_output_to_log() -> Iterator[None]:
    """While it lasts, this process's file descriptors 1 and 2 write to the log file (when the
    console is quiet): what an engine prints outside Python logging -- C++ warnings, its engine
    core subprocess (which inherits them), weight-loading bars -- stays off the console."""
    if _quiet_log_file is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(_quiet_log_file, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


@ray.remote(num_cpus=0)
class ProgressBoard:
    """Where the rank-0 training worker posts its step and latest metrics for the driver, and
    the step each start of the worker group began at (a checkpoint's, or 0)."""

    def __init__(self) -> None:
        self.step, self.metrics = 0, {}
        self.starts: list[int] = []

    def post(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        self.step = step
        if metrics:
            self.metrics = metrics

    def started(self, step: int) -> None:
        self.step = step
        self.starts.append(step)

    def read(self) -> tuple[int, dict[str, Any], list[int]]:
        return self.step, self.metrics, self.starts


class TrainingBar:
    """A driver-side tqdm bar following a `ProgressBoard` (a thread polls it)."""

    def __init__(self, board, total: int, poll_s: float = 0.5, start: int = 0) -> None:
        """`start`: the step a resumed run begins at."""
        self.board, self.poll_s = board, poll_s
        self._starts_seen = 0
        self.bar = tqdm(total=total, initial=min(start, total), desc="training", unit="step",
                        file=sys.stderr, mininterval=1.0)
        self._shown_metrics_step = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> TrainingBar:
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._refresh()

    def _refresh(self) -> None:
        try:
            step, metrics, starts = ray.get(self.board.read.remote(), timeout=10)
        except Exception:  # the board is gone (job ending): nothing to show
            return
        for started in starts[self._starts_seen:]:
            self._starts_seen += 1
            if self._starts_seen == 1:
                continue  # the group's first start (at an earlier run's checkpoint, or 0)
            logger.warning("a training worker failed: Ray Train restarted the worker group, "
                           "which resumed from %s (train.max_failures; docs/operations.md, "
                           "\"A job failed\")", f"its checkpoint at step {started}"
                           if started else "the beginning (no checkpoint yet)")
            self.bar.n = started
            self.bar.refresh()
        if metrics and metrics.get("step") != self._shown_metrics_step:  # redraw on news only
            self._shown_metrics_step = metrics.get("step")
            self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}",
                                 tok_s=f"{metrics['supervision_tokens_per_s']:.0f}",
                                 refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._refresh()
        self.bar.close()
