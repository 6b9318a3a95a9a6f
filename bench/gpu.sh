#!/usr/bin/env bash
# Launch: bash bench/gpu.sh   (on a CUDA machine: at most ~10 minutes, each stage has a timeout)
#
# 1. a venv on top of the machine's CUDA torch (--system-site-packages: no multi-GB download),
#    with kiln and what the GPU checks need (pytest, torchao for fp8);
# 2. the CUDA tests (pytest -m cuda): fused kernels vs their references, precision and MFU peak,
#    bf16 autocast, compile + activation checkpointing, checkpoint resume, fp8;
# 3. bench/gpu_bench.py: tokens/s, MFU and peak memory of Llama-3.2-1B (bf16, compile,
#    activation checkpointing), then fp8 vs bf16 on a Llama-3.2-3B shape, as one table;
# 4. the same for a Qwen3-MoE shape (Qwen3-30B-A3B's layers, 6 of 48; bf16, grouped GEMMs).
# Environment: KILN_GPU_VENV (default .venv-gpu), KILN_GPU_CASES (default the three dense rows;
# the MoE row has its stage).
# A step that fails is reported and the script goes on; the exit status is non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's kiln even if pip fails
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
VENV="${KILN_GPU_VENV:-.venv-gpu}"
status=0
started=$SECONDS
stage() { printf '\n=== %s (%ds) ===\n' "$1" $((SECONDS - started)); }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PY=python3
if [ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"; then
    PY="$VENV/bin/python"
    # kiln's runtime dependencies, pytest, and torchao pinned as in pyproject.toml's fp8 extra.
    if ! timeout 90 "$PY" -m pip install -q --disable-pip-version-check -e ".[fp8]" "pytest>=8"; then
        echo "gpu.sh: pip install failed; going on with what is installed" >&2
    fi
else
    echo "gpu.sh: could not create $VENV; using $(command -v python3)" >&2
fi
"$PY" - <<'EOF' || { echo "gpu.sh: torch with CUDA is needed" >&2; exit 2; }
import sys, torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
p = torch.cuda.get_device_properties(0)
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{p.name} ({p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor})")
try:
    import torchao
    print(f"torchao {torchao.__version__}")
except ImportError as e:
    print(f"torchao missing ({e}): the fp8 rows and test will be skipped or fail")
EOF

stage "CUDA tests"
timeout 130 "$PY" -m pytest -q -m cuda -p no:cacheprovider -p no:logging -rs tests/test_cuda.py || status=1

stage "throughput"
# The bench keeps its own budget so that the table is printed even when a row runs long.
timeout 285 "$PY" bench/gpu_bench.py --cases "${KILN_GPU_CASES:-1b-bf16,3b-bf16,3b-fp8}" \
    --timeout 130 --budget 270 || status=1

stage "MoE throughput"
timeout 100 "$PY" bench/gpu_bench.py --cases moe-bf16 --timeout 90 --budget 95 || status=1

stage "done, status $status"
exit $status
