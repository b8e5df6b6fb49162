#!/usr/bin/env bash
# Sets up the environment (setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash setup.sh
exec .venv/bin/python -m pytest tests "$@"
