#!/usr/bin/env bash
# deps.sh - install what dsagent needs to build and test; idempotent.
#
# Debian packages through apt-get (only the missing ones, so a second run does
# nothing), then the Python test packages into the project's .venv.
# Called by `make deps`, `make test` and `make up`.
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(build-essential pkg-config ca-certificates curl
      libsqlite3-dev libmicrohttpd-dev libcurl4-openssl-dev libsodium-dev
      libjansson-dev libsystemd-dev libgloo-dev python3 python3-venv python3-pip)

missing=()
for p in "${PKGS[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "deps: installing Debian packages: ${missing[*]}"
	SUDO=""
	[ "$(id -u)" -eq 0 ] || SUDO="sudo"
	export DEBIAN_FRONTEND=noninteractive
	$SUDO apt-get update -q
	$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
REQ=tests/requirements.txt
stamp="$VENV/.deps-stamp"
if [ ! -x "$VENV/bin/python" ]; then
	echo "deps: creating $VENV"
	"$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || ! cmp -s "$REQ" "$stamp"; then
	echo "deps: installing Python test packages from $REQ"
	"$VENV/bin/python" -m pip install -q --upgrade pip
	"$VENV/bin/python" -m pip install -q -r "$REQ"
	cp "$REQ" "$stamp"
fi
