#!/usr/bin/env bash
# run_tests.sh - run the test tiers and close with one combined count.
#
#   tools/run_tests.sh [unit] [conformance] [integration]   (default: all three)
#
# Each tier prints its own summary; the last line sums them:
#   "tests: N passed, N failed"
# Exit status is non-zero when any tier failed or a tier could not run.
# Environment: DS_BUILD (build dir, default build), VENV (default .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${DS_BUILD:-build}
VENV=${VENV:-.venv}
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(unit conformance integration)

total_pass=0 total_fail=0 status=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

count() { # $1 = regex word (passed|failed); reads the tier's summary line
	grep -oE "[0-9]+ $1" <<<"$2" | tail -1 | grep -oE '^[0-9]+' || echo 0
}

for t in "${tiers[@]}"; do
	echo "=== tier: $t"
	case "$t" in
	unit) "$BUILD/tests/unit" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
	      line=$(grep -E '^unit: ' "$log" | tail -1) ;;
	conformance) "$BUILD/tests/conformance" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
	      line=$(grep -E '^conformance: ' "$log" | tail -1) ;;
	integration) DS_BUILD="$BUILD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
	          tests/integration 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
	      line=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1) ;;
	*) echo "run_tests: unknown tier '$t'"; exit 2 ;;
	esac
	if [ -z "$line" ]; then
		echo "run_tests: tier $t printed no summary (exit $rc)"
		status=1
		total_fail=$((total_fail + 1))
		continue
	fi
	p=$(count passed "$line"); f=$(count failed "$line")
	[ "$rc" -ne 0 ] && status=1 && [ "$f" -eq 0 ] && f=1
	total_pass=$((total_pass + p)); total_fail=$((total_fail + f))
done
echo "tests: $total_pass passed, $total_fail failed"
exit $status
