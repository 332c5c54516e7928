"""Build (once) and cache a virtualenv holding vLLM 0.33.0's real KV-event publisher.

The recipe: `pip install --no-deps vllm==0.33.0`, then the pins of
`tests/support/vllm-events-requirements.txt` (torch 2.13.0 among them), all
`--no-deps`: letting pip resolve vLLM's own requirements pulls
triton and 3+ GB. `vllm.distributed.kv_events` imports torch and much of vLLM but
none of its compiled CUDA libraries, so this runs the real publisher
(`ZmqEventPublisher`, `KVEventBatch`, the scheduler-side `BlockPool`) without a GPU:
about 2.1 GB on disk, about a minute from a warm package cache. The venv lives in
`.cache/vllm-venv` under the repository root and is reused while its stamp matches
the recipe.

Run as a script to build it ahead of the tests: `.venv/bin/python tests/support/vllm_env.py`.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.33.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = REPO_ROOT / ".cache" / "vllm-venv"
REQUIREMENTS = Path(__file__).resolve().parent / "vllm-events-requirements.txt"
_STAMP = VENV_DIR / ".kvrc-stamp"
_LOCK = REPO_ROOT / ".cache" / "vllm-venv.lock"
_BUILD_TIMEOUT_S = 1800


class VllmEnvUnavailable(RuntimeError):
    """The vLLM venv cannot be built here; the message says why."""


def _recipe_digest() -> str:
    digest = hashlib.sha256(f"vllm=={VLLM_VERSION}\n".encode())
    digest.update(REQUIREMENTS.read_bytes())
    return digest.hexdigest()


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise VllmEnvUnavailable(
            f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        )


def ensure_vllm_venv() -> Path:
    """Return the venv's python, building the venv first if needed.

    Raises VllmEnvUnavailable with the reason when it cannot be built.
    """
    if not REQUIREMENTS.is_file():
        raise VllmEnvUnavailable(f"recipe not found: {REQUIREMENTS}")
    digest = _recipe_digest()
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (pytest-xdist workers, a script run beside the tests).
    with _LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _STAMP.is_file() and _STAMP.read_text() == digest and venv_python().exists():
            return venv_python()
        if not venv_python().exists():
            _run([sys.executable, "-m", "venv", str(VENV_DIR)])
        pip = [str(venv_python()), "-m", "pip", "install", "-q", "--no-deps"]
        _run([*pip, f"vllm=={VLLM_VERSION}"])
        _run([*pip, "-r", str(REQUIREMENTS)])
        _run([str(venv_python()), "-c", "import vllm.distributed.kv_events"])
        _STAMP.write_text(digest)
        return venv_python()


if __name__ == "__main__":
    try:
        print(ensure_vllm_venv())
    except VllmEnvUnavailable as exc:
        print(f"vLLM venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)
