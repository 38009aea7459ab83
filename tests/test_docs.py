"""The repository explains itself: the generated references (docs/configuration.md from the
config fields' docstrings, docs/benchmarks.md from the saved benchmark runs) are current, every
key has a docstring, every command is documented, and the README stays a front page."""

import dataclasses
import re
from pathlib import Path

import pytest

from eagle_ray.bench import markdown, tables
from eagle_ray.cli import build_parser
from eagle_ray.config import JobConfig, PoolConfig, reference

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate it with `make docs`"


def test_the_configuration_reference_is_generated_from_the_current_fields():
    assert (ROOT / "docs/configuration.md").read_text() == reference.render(), REGENERATE


def test_every_section_of_a_job_config_has_its_table():
    import dataclasses

    from eagle_ray.config import JobConfig

    nested = {f.name for f in dataclasses.fields(JobConfig)
              if dataclasses.is_dataclass(f.default_factory() if callable(f.default_factory)
                                          else f.default)}
    listed = {prefix.rstrip(".") for _, prefix, _ in reference.SECTIONS}
    assert nested and nested <= listed, nested - listed


def test_the_benchmark_tables_are_generated_from_the_saved_runs():
    assert (ROOT / "docs/benchmarks.md").read_text() == \
        tables.render(ROOT / "benchmarks/results"), REGENERATE


def test_published_benchmarks_come_from_commits_and_read_in_an_editor():
    dirty = [path.name for path in (ROOT / "benchmarks/results").glob("*/*.jsonl")
             if "-dirty" in path.name or '-dirty"' in path.read_text()]
    assert not dirty, f"results from uncommitted code (run them again from a commit): {dirty}"
    long_lines = [n for n, line in enumerate((ROOT / "docs/benchmarks.md").read_text()
                                             .splitlines(), 1) if len(line) > markdown.MAX_LINE]
    assert not long_lines, f"docs/benchmarks.md lines over {markdown.MAX_LINE}: {long_lines}"


def test_a_key_without_a_docstring_fails_the_reference():
    """The control: a field documented only by a comment is refused, naming it."""
    @dataclasses.dataclass
    class Documented:
        size: int = 1
        """How big."""
        colour: str = "red"  # a comment is not documentation the reference can read

    with pytest.raises(ValueError, match="Documented.colour has no docstring"):
        reference.field_docs(Documented)


def test_every_command_is_documented():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    undocumented = [name for name in subcommands if f"eagle-ray {name}" not in text]
    assert not undocumented, f"commands missing from README.md and docs/: {undocumented}"


def test_the_readme_is_a_front_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert {"docs/architecture.md", "docs/configuration.md", "docs/benchmarks.md"} <= set(links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_nested_configs_accept_plain_mappings():
    """As Ray Serve takes `autoscaling_config`: a dict is converted and checked at construction."""
    pool = PoolConfig(autoscaling={"min_replicas": 1, "max_replicas": 3}, replicas=2)
    assert pool.autoscaling.max_replicas == 3 and pool.initial_replicas == 2
    job = JobConfig(target={"autoscaling": {"max_replicas": 2}}, train={"steps": 3})
    assert job.target.autoscaling.max_replicas == 2 and job.train.steps == 3
    with pytest.raises(ValueError, match="unknown key autoscaling.min_replica"):
        PoolConfig(autoscaling={"min_replica": 1})
    with pytest.raises(TypeError, match="PoolConfig.autoscaling must be AutoscalingConfig"):
        PoolConfig(autoscaling=3)
