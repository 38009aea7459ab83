"""What a person sees: eagle_ray's stage lines and real errors on the console, the libraries'
chatter (Ray Data, vLLM's own logging config, Python warnings, what native code writes to the
file descriptors) in the job's log file; `--verbose` puts it all back on the console. And the
summary table says what the summary says."""

import subprocess
import sys
import textwrap

import pytest

from eagle_ray.draft.serving import DraftServing
from eagle_ray.train.report import format_summary

# Each line comes from a different route a library takes to the console.
SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from eagle_ray.console import native_output_to_log, setup_console

    setup_console(sys.argv[1], verbose=sys.argv[2] == "1")
    logging.getLogger("eagle_ray.train.job").info("STAGE pool ready")
    logging.getLogger("ray.data").info("NOISE ray data execution plan")
    import vllm  # configures its loggers from VLLM_LOGGING_CONFIG_PATH
    logging.getLogger("vllm.engine").info("NOISE vllm engine started")
    warnings.warn("NOISE a deprecation")
    with native_output_to_log():
        os.write(2, b"NOISE native warning from an engine\\n")
    logging.getLogger("some.library").error("ERROR something failed")
""")


def run_script(tmp_path, verbose: bool):
    log = tmp_path / "job.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log), "1" if verbose else "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr, log.read_text()


@pytest.mark.slow  # imports vLLM in a subprocess (~10 s)
def test_the_quiet_console_shows_stages_and_errors_and_logs_the_rest(tmp_path):
    console, log = run_script(tmp_path, verbose=False)
    assert "STAGE pool ready" in console and "ERROR something failed" in console
    assert "NOISE" not in console, console
    for noise in ("ray data execution plan", "vllm engine started", "a deprecation",
                  "native warning from an engine"):
        assert f"NOISE {noise}" in log, noise


@pytest.mark.slow
def test_verbose_puts_everything_back_on_the_console(tmp_path):
    console, _ = run_script(tmp_path, verbose=True)
    for line in ("STAGE pool ready", "NOISE ray data execution plan", "NOISE vllm engine started",
                 "NOISE a deprecation", "NOISE native warning from an engine",
                 "ERROR something failed"):
        assert line in console, line


SUMMARY = {
    "run_name": "r1",
    "data": {"kept": 1234, "truncated": 5, "dropped_too_long": 0, "dropped_no_answer": 2,
             "dropped_unrenderable": 1, "training_tokens": 98765},
    "regenerated": {"conversations": 1000, "resumed": 234, "changed_share": 0.75, "failed": 0},
    "final_metrics": {"step": 150, "loss_0": 0.21, "loss_1": 0.19, "acc_0": 0.95, "acc_1": 0.93,
                      "supervision_tokens_per_s": 3281.0, "pool_wait_share": 0.09,
                      "data_wait_share": 0.01},
    "eval": {"prompts": 8, "turns": 11, "failed_prompts": 0, "skipped_lines": {"not JSON": 1},
             "simulated": [{"num_speculative_tokens": 2, "temperature": 0.0, "trained": 2.94,
                            "untrained": 1.0,
                            "acceptance_per_position_trained": [0.97, 0.88],
                            "acceptance_per_position_untrained": [0.0, 0.0]}],
             "vllm": [{"num_speculative_tokens": 2, "temperature": 0.0,
                       "mean_acceptance_length": 2.91, "interval_95": [2.8, 3.0],
                       "acceptance_per_position": [0.96, 0.87], "greedy_equal_fraction": 1.0,
                       "failed": 0},
                      {"num_speculative_tokens": 2, "temperature": 1.0,
                       "mean_acceptance_length": 2.5, "interval_95": [2.25, 2.75],
                       "acceptance_per_position": [0.8, 0.7], "failed": 0}]},
    "draft_dir": "/runs/x/draft",
}


def test_the_summary_table_carries_the_summarys_figures():
    command = DraftServing("/models/My 8B", "/runs/x/draft", "bfloat16", tp_size=2).command(2)
    table = format_summary({**SUMMARY, "serve_command": command})
    lines = table.splitlines()
    assert "1,234 conversations trained on, 5 truncated, 3 dropped (98,765 tokens)" in table
    assert "1,234 conversations, 75% changed" in table
    assert any(line.split() == ["loss", "0.21", "0.19"] for line in lines)
    assert any(line.split() == ["accuracy", "0.95", "0.93"] for line in lines)
    assert "3,281 tok/s" in table and "pool 9%" in table and "data 1%" in table
    assert "on 8 prompts (11 turns); 95% intervals" in table
    assert any(line.split() == ["k=2,", "t=0", "k=2,", "t=1"] for line in lines)
    assert any(line.split() == ["vLLM,", "trained", "draft", "2.91", "[2.80-3.00]", "2.50",
                                "[2.25-2.75]"] for line in lines)
    assert any(line.split() == ["simulated,", "trained", "2.94", "-"] for line in lines)
    assert any(line.split() == ["simulated,", "untrained", "1.00", "-"] for line in lines)
    assert any(line.split() == ["greedy", "output", "unchanged", "100%", "-"] for line in lines)
    assert "0 failed prompts, 1 unreadable lines" in table
    assert any(line.split() == ["vLLM,", "t=0", "0.96", "0.87"] for line in lines)
    assert any(line.split() == ["vLLM,", "t=1", "0.80", "0.70"] for line in lines)
    assert lines[-1].strip() == command
    assert command == ("vllm serve '/models/My 8B' --dtype bfloat16 --tensor-parallel-size 2 "
                       "--speculative-config '{\"method\": \"eagle3\", \"model\": "
                       "\"/runs/x/draft\", \"num_speculative_tokens\": 2}'")


def test_the_exact_expectation_stands_beside_vllm_and_the_simulation():
    from eagle_ray.train.report import acceptance_lines

    per_position = {"acceptance_per_position_trained": [0.9, 0.8, 0.7],
                    "acceptance_per_position_untrained": [0.0, 0.0, 0.0]}
    greedy = {"num_speculative_tokens": 3, "temperature": 0.0, "trained": 2.9,
              "untrained": 1.0, **per_position}
    sampled = {**greedy, "temperature": 1.0, "trained": 2.2, "trained_expected": 2.25,
               "trained_expected_interval_95": [2.1, 2.4]}
    measured = [{"num_speculative_tokens": 3, "temperature": t, "mean_acceptance_length": m,
                 "interval_95": [m - 0.2, m + 0.2], "acceptance_per_position": [0.5] * 3}
                for t, m in ((0.0, 2.9), (1.0, 2.3))]
    report = {"prompts": 6, "turns": 6, "vllm": measured, "simulated": [greedy, sampled],
              "target_top_probability": 0.7912}
    lines = acceptance_lines(report)
    # Greedy, the simulation is the exact figure; sampled, the expectation with its range.
    assert any(line.split() == ["exact,", "trained", "2.90", "2.25", "[2.10-2.40]"]
               for line in lines)
    assert any("top probability along its greedy answers 0.79" in line for line in lines)
    assert not any("disagree" in line for line in lines)
    # The control: vLLM's interval apart from the exact range is called out, naming the setting.
    measured[1].update(mean_acceptance_length=1.1, interval_95=[1.0, 1.2])
    apart = [line for line in acceptance_lines(report) if "disagree" in line]
    assert len(apart) == 1 and "k=3, t=1" in apart[0] and "k=3, t=0" not in apart[0]


def test_sampled_the_exact_figure_is_the_one_on_vllms_own_answers():
    """Where the evaluation replayed vLLM's sampled answers, that expectation is the row "exact,
    trained" (its range vLLM's figure falls in), and vLLM AGREEMENT_Z standard errors from it
    is called out however wide vLLM's interval over prompts: 10 % under, with a standard error
    of 0.05, is flagged, the figure itself is not."""
    from eagle_ray.train.report import acceptance_lines, vllm_agrees

    paired = {"expected": 2.0, "standard_error": 0.05, "interval_95": [1.902, 2.098],
              "verify_steps": 400, "acceptance_per_position": [0.5] * 7}
    sampled = {"num_speculative_tokens": 7, "temperature": 1.0, "trained": 2.6,
               "untrained": 1.0, "trained_expected": 2.6,
               "trained_expected_interval_95": [2.2, 3.0], "trained_on_vllm_answers": paired,
               "acceptance_per_position_trained": [0.5] * 7,
               "acceptance_per_position_untrained": [0.0] * 7}
    measured = {"num_speculative_tokens": 7, "temperature": 1.0, "mean_acceptance_length": 2.04,
                "interval_95": [1.6, 2.5], "acceptance_per_position": [0.5] * 7}
    report = {"prompts": 8, "turns": 8, "vllm": [measured], "simulated": [sampled]}
    lines = acceptance_lines(report)
    assert any(line.split() == ["exact,", "trained", "2.00", "[1.90-2.10]"] for line in lines)
    assert vllm_agrees(measured, sampled) and not any("disagree" in line for line in lines)
    measured["mean_acceptance_length"] = 1.8  # 10 % under: z = -4
    assert not vllm_agrees(measured, sampled)
    assert any("disagree at k=7, t=1" in line for line in acceptance_lines(report))
    # The control: without the replay, the weak test of overlapping intervals passes it.
    del sampled["trained_on_vllm_answers"]
    assert vllm_agrees(measured, sampled)


def test_the_draft_line_gives_the_counted_forwards_and_flags_a_draft_run_against_its_kind():
    from eagle_ray.train.report import acceptance_lines

    def draft_line(**draft):
        report = {"prompts": 1, "turns": 1, "draft": {"kind": "peagle", **draft}}
        return next(line for line in acceptance_lines(report) if line.startswith("  draft"))

    line = draft_line(forwards_per_verify_step={"3": 1.0, "7": None}, drafts_as_its_kind=True,
                      seconds_per_verify_step={"3": 0.002})
    assert "1 forward(s) 2.0 ms at k=3, forwards not counted at k=7" in line
    assert "not what its kind runs" not in line
    # The control: counts a P-EAGLE draft does not run (served as a chain) are called out.
    assert draft_line(forwards_per_verify_step={"3": 3.0}, drafts_as_its_kind=False).endswith(
        "3 forward(s) at k=3 (counted in vLLM: not what its kind runs)")


def test_report_png_has_no_empty_panel_without_an_evaluation(tmp_path):
    """With an evaluation: the training row and the acceptance row; without one, the training
    row alone (no blank panels)."""
    from PIL import Image

    from eagle_ray.train.report import REPORT_SIZE_PX, TRAINING_ONLY_SIZE_PX, write_report_png

    metrics = [{"step": s, "loss_0": 3.0 / s, "acc_0": 0.1 * s, "supervision_tokens_per_s": 900.0,
                "pool_wait_share": 0.1, "data_wait_share": 0.0} for s in (1, 2, 3)]
    greedy = {"num_speculative_tokens": 3, "temperature": 0.0, "trained": 2.5, "untrained": 1.0,
              "acceptance_per_position_trained": [0.8, 0.5, 0.2],
              "acceptance_per_position_untrained": [0.0, 0.0, 0.0]}
    evaluated = {"prompts": 2, "turns": 2, "simulated": [greedy], "vllm": [
        {"num_speculative_tokens": 3, "temperature": 0.0, "mean_acceptance_length": 2.5,
         "interval_95": [float("nan"), float("nan")], "acceptance_per_position": [0.8, 0.5, 0.2]}]}
    for summary, size in (({"eval": evaluated}, REPORT_SIZE_PX), ({}, TRAINING_ONLY_SIZE_PX)):
        path = write_report_png(summary, metrics, tmp_path / f"{size[1]}.png")
        with Image.open(path) as image:
            assert image.size == size
