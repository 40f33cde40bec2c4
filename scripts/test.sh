#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (CPU only, ~minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
