#!/usr/bin/env bash
# Every benchmark of docs/benchmarks.md in one invocation: ours vs torch.distributed.pipelining and
# torch.distributed.tensor.parallel, vs the single-process baseline, bubble, peak memory per stage.
#   bash benchmarks/run.sh                 # ~7 minutes on 2 CPU cores
#   PYTHON=.venv/bin/python bash benchmarks/run.sh --repeat 20
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
exec "$PYTHON" benchmarks/report.py "$@"
