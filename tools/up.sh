#!/usr/bin/env bash
# up.sh - `make up`: start dsagent on this machine in the foreground.
# The data directory lives under the project (run/data); Ctrl-C stops it.
# It grows with the product: model serving and API keys join in later steps.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DATA=run/data
PORT=${DS_CONTROL_PORT:-7481}
mkdir -p "$DATA"
cat <<MSG
dsagent is starting on 127.0.0.1:$PORT (data in $DATA). Try, in another shell:
  curl http://127.0.0.1:$PORT/health
  $BUILD/dsctl --agent http://127.0.0.1:$PORT health
Ctrl-C stops it.
MSG
exec "$BUILD/dsagent" --bind 127.0.0.1 --control-port "$PORT" --data-dir "$DATA" \
	--config examples/dsagent.conf
