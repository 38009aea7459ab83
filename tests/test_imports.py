"""The package's shape: it imports without vLLM, the contract stays free of Ray and vLLM, its
modules import each other in one direction only (no cycles), and no module or function grows past
a size a reader can hold."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import eagle_ray

PACKAGE_DIR = Path(eagle_ray.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80  # a function does one thing a reader can follow
# The vLLM KV-connector plug-in: only vLLM loads it, and it subclasses a vLLM class.
VLLM_PLUGINS = {"eagle_ray.backends.vllm.connector", "eagle_ray.backends.vllm.mixtral"}
# Beside the contract's package (every module of `eagle_ray.contract`), usable in any process
# with neither Ray nor vLLM: the HF backend and what it needs.
RAY_FREE = ["eagle_ray.backends.base", "eagle_ray.backends.hf", "eagle_ray.config",
            "eagle_ray.tiny"]

# `eagle-ray bench gpu` and the training loop's learner it runs: the lent GPU machine has torch
# and transformers, neither Ray nor vLLM.
GPU_CHECK = ["eagle_ray.bench.gpu", "eagle_ray.train.loop"]

BLOCK_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is not installed (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def all_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package is its `__init__.py`)."""
    modules = {"eagle_ray": PACKAGE_DIR / "__init__.py"}
    for info in pkgutil.walk_packages([str(PACKAGE_DIR)], prefix="eagle_ray."):
        relative = Path(*info.name.split(".")[1:])
        path = PACKAGE_DIR / relative / "__init__.py" if info.ispkg else (
            PACKAGE_DIR / relative.with_suffix(".py"))
        modules[info.name] = path
    return modules


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """eagle_ray modules that `path` imports anywhere (module level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from eagle_ray.pool import client` imports a module; `... import TargetPool` not.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                     else node.module for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done:
            return None
        visiting.append(module)
        for dependency in sorted(graph[module]):
            cycle = visit(dependency)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_every_module_but_the_vllm_plugins_imports_without_vllm():
    modules = sorted(set(all_modules()) - VLLM_PLUGINS)
    assert len(modules) > 20, modules
    code = BLOCK_VLLM + "".join(f"import {m}\n" for m in modules) + "print('ok')"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_nothing_in_the_package_imports_the_vllm_plugins():
    modules = all_modules()
    importers = [name for name, path in modules.items()
                 if VLLM_PLUGINS & imported_modules(path, set(modules))]
    assert importers == []


def test_nothing_in_the_package_imports_speculators():
    """speculators is the loss tests' oracle (installed for tests only), never the product's."""
    importers = []
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "speculators" or n.startswith("speculators.") for n in names):
                importers.append(name)
    assert importers == []


def test_contract_and_hf_backend_import_neither_ray_nor_vllm():
    contract = sorted(m for m in all_modules() if m.startswith("eagle_ray.contract."))
    assert len(contract) >= 7, contract
    code = (f"import sys, {', '.join(contract + RAY_FREE)}\n"
            "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def ray_or_vllm_imported_by(modules: list[str]) -> list[str]:
    """Which of Ray and vLLM importing `modules` (in a fresh process) imports."""
    result = run_python(f"import sys, {', '.join(modules)}\n"
                        "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())


def test_the_gpu_check_and_the_learner_import_neither_ray_nor_vllm():
    assert ray_or_vllm_imported_by(GPU_CHECK) == []
    assert ray_or_vllm_imported_by(["eagle_ray.pool"]) == ["ray"]  # the probe sees Ray


def test_vllm_backend_module_does_not_import_vllm():
    code = ("import sys, eagle_ray.backends.vllm.target, eagle_ray.backends.vllm.runner; "
            "print('vllm' in sys.modules)")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_managing_a_pool_imports_neither_torch_nor_transformers():
    """`eagle-ray status | shutdown` answer in about a second, not after torch's import."""
    code = ("import sys, eagle_ray.cli, eagle_ray.cluster\n"
            "from eagle_ray.pool import TargetPool\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_batch_record_imports_nothing_of_the_package():
    modules = all_modules()
    assert imported_modules(modules["eagle_ray.contract.target_batch"], set(modules)) == set()


def test_no_import_cycles_in_the_package():
    modules = all_modules()
    graph = {name: imported_modules(path, set(modules)) - {name}
             for name, path in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


RAY_PRIVATE = ("ray._private", "internal_kv", "._actor_id", "ray._raylet")


def test_rays_private_apis_are_used_in_one_module_only():
    """`eagle_ray.ray_compat` holds them all, each with why; elsewhere they would break
    silently on a Ray upgrade."""
    users = {name: [marker for marker in RAY_PRIVATE if marker in path.read_text()]
             for name, path in all_modules().items()}
    assert {name for name, markers in users.items() if markers} == {"eagle_ray.ray_compat"}, users


def test_no_module_is_longer_than_a_reader_can_hold():
    lengths = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert too_long == {}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """{function name: lines} of every function (nested ones too) longer than `limit`."""
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > limit}


def test_no_function_is_longer_than_a_reader_can_follow():
    too_long = {f"{name}.{function}": n for name, path in all_modules().items()
                for function, n in long_functions(path.read_text()).items()}
    assert too_long == {}


def test_the_length_check_finds_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert long_functions(f"def f():\n{body}\n") == {"f": 81}
    assert long_functions(f"def f():\n{body}\n", limit=81) == {}


def test_a_replica_and_the_test_backends_start_without_transformers():
    """A replica process imports what its backend needs: the synthetic and fixed-latency
    backends, and the contract they share, need no transformers (~4 s of each start)."""
    code = ("import sys, eagle_ray.pool.replica, eagle_ray.pool.router, eagle_ray.testing\n"
            "print('transformers' in sys.modules)")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_public_backend_paths_still_name_the_backends():
    """`eagle_ray.target_runner`, `eagle_ray.hf_target` and `eagle_ray.vllm_target` are the
    public paths; the code lives in `eagle_ray.backends` and they re-export it."""
    from eagle_ray import hf_target, target_runner, vllm_target
    from eagle_ray.backends import base, hf
    from eagle_ray.backends.vllm import target

    assert hf_target.HFEagle3TargetModel is hf.HFEagle3TargetModel
    assert vllm_target.VLLMEagle3TargetModel is target.VLLMEagle3TargetModel
    assert set(target_runner.__all__) == set(base.__all__)
    assert all(getattr(target_runner, n) is getattr(base, n) for n in base.__all__)


MAX_ROOT_MODULES = 15


def test_the_package_root_holds_few_modules():
    """What the root holds is what the jobs share; the rest lives in the package of its part
    (docs/architecture.md, "Modules")."""
    root = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
