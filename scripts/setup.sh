#!/usr/bin/env bash
# Create .venv and install kiln (and, with "test", the test-only reference libraries).
# torch is pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".${extras}"
