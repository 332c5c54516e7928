"""Fixtures of the `vllm` tests: the cached vLLM venv, the tiny model, kvrc.

The venv is built once (tests/kvrc_vllm/vllm_cpu_env.py); when it cannot be built
the tests fail with the reason (they never skip).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvrc_vllm.vllm_cpu_env import VllmCpuEnvError, ensure_vllm_cpu_venv
from kvrc_vllm.vllm_harness import REPO

MODEL_DIR = REPO / ".cache" / "tiny-llama"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: runs real vLLM engines (the cached vllm-cpu venv)")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    try:
        return str(ensure_vllm_cpu_venv())
    except VllmCpuEnvError as exc:
        pytest.fail(f"the vLLM venv cannot be built: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    proc = subprocess.run(
        [vllm_python, "-m", "clients.vllm.tiny_model", str(MODEL_DIR)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"the tiny model was not made:\n{proc.stderr[-3000:]}", pytrace=False)
    return MODEL_DIR
