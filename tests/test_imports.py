"""The package imports on machines without vLLM, and the contract stays free of Ray and vLLM."""

import subprocess
import sys

BLOCK_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is not installed (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_package_imports_without_vllm():
    modules = ["eagle_ray", "eagle_ray.target_runner", "eagle_ray.hf_target",
               "eagle_ray.supervision", "eagle_ray.testing", "eagle_ray.cli",
               "eagle_ray.vllm_target", "eagle_ray.vllm_runner", "eagle_ray.vllm_handoff",
               "eagle_ray.checkpoint", "eagle_ray.vllm_connector"]
    code = BLOCK_VLLM + "".join(f"import {m}\n" for m in modules) + "print('ok')"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_contract_and_hf_backend_import_neither_ray_nor_vllm():
    code = ("import sys, eagle_ray.target_runner, eagle_ray.hf_target\n"
            "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_vllm_backend_module_does_not_import_vllm():
    code = "import sys, eagle_ray.vllm_target, eagle_ray.vllm_runner; print('vllm' in sys.modules)"
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
