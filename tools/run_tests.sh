#!/usr/bin/env bash
# run_tests.sh - run the test tiers and close with one combined count.
#
#   tools/run_tests.sh [unit] [conformance] [integration]   (default: all three)
#   tools/run_tests.sh --count TIER < LOG                    (the counts of one log)
#
# Each tier prints its own summary; the last line sums them:
#   "tests: N passed, N failed, N skipped"
# What counts where:
#   unit, conformance  their own closing line "TIER: N passed, N failed, N skipped";
#   integration        pytest's summary line: passed; failed plus errors (a fixture
#                      or a module that raised is a failure, not a silence);
#                      skipped plus xfailed plus xpassed.  A non-strict xpass is
#                      counted as skipped (the test may pass, nobody relies on
#                      it); a strict one pytest itself reports as failed, so it
#                      counts as failed.
# A tier that exits non-zero without a failure in its count, or prints no
# summary, adds one failure.  Exit status is non-zero when anything failed.
# Environment: DS_BUILD (build dir, default build), VENV (default .venv),
# INTEGRATION (what pytest runs, default tests/integration; e.g. one file).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${DS_BUILD:-build}
VENV=${VENV:-.venv}

num() { # $1 = word, $2 = summary line: the number before the word, or 0
	local n
	n=$(grep -oE "[0-9]+ $1\b" <<<"$2" | tail -1 | grep -oE '^[0-9]+')
	echo "${n:-0}"
}

summary_of() { # $1 = tier, reads its log on stdin; prints the summary line
	case "$1" in
	unit | conformance) grep -E "^$1: [0-9]+ passed" | tail -1 ;;
	integration) grep -E '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b' |
		grep -vE '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' | tail -1 ;;
	esac
}

counts() { # $1 = tier, $2 = summary line: prints "passed failed skipped"
	local p f s
	p=$(num passed "$2")
	f=$(($(num failed "$2") + $(num errors "$2") + $(num error "$2")))
	s=$(($(num skipped "$2") + $(num xfailed "$2") + $(num xpassed "$2")))
	echo "$p $f $s"
}

if [ "${1:-}" = "--count" ]; then
	line=$(summary_of "${2:?--count needs a tier}")
	read -r p f s <<<"$(counts "$2" "$line")"
	echo "$2: $p passed, $f failed, $s skipped"
	exit 0
fi

tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=(unit conformance integration)

total_pass=0 total_fail=0 total_skip=0 status=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

for t in "${tiers[@]}"; do
	echo "=== tier: $t"
	case "$t" in
	unit) "$BUILD/tests/unit" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]} ;;
	conformance) "$BUILD/tests/conformance" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]} ;;
	integration) DS_BUILD="$BUILD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
	          -rfEs ${INTEGRATION:-tests/integration} 2>&1 | tee "$log"; rc=${PIPESTATUS[0]} ;;
	*) echo "run_tests: unknown tier '$t'"; exit 2 ;;
	esac
	line=$(summary_of "$t" <"$log")
	if [ -z "$line" ]; then
		echo "run_tests: tier $t printed no summary (exit $rc)"
		status=1
		total_fail=$((total_fail + 1))
		continue
	fi
	read -r p f s <<<"$(counts "$t" "$line")"
	[ "$f" -ne 0 ] && status=1
	[ "$rc" -ne 0 ] && status=1 && [ "$f" -eq 0 ] && f=1
	total_pass=$((total_pass + p)) total_fail=$((total_fail + f)) total_skip=$((total_skip + s))
done
echo "tests: $total_pass passed, $total_fail failed, $total_skip skipped"
exit $status
