#!/usr/bin/env bash
# check.sh - `make check`: style rules that a compiler does not enforce.
#
#  1. banned functions (unbounded or unchecked): strcpy strcat sprintf vsprintf
#     gets atoi atol atoll atof strtok tmpnam
#  2. include direction: common <- kernels <- engine <- agent; ctl may include
#     common/ and ctl/ only; tests may include anything
#  3. every .c/.cu file opens with a comment saying what it is for
# Prints each finding as file:line: message and exits non-zero if any.
set -uo pipefail
cd "$(dirname "$0")/.."
bad=0
src=$(git ls-files -co --exclude-standard -- '*.c' '*.h' '*.cu' '*.cuh' 2>/dev/null)

banned='\b(strcpy|strcat|sprintf|vsprintf|gets|atoi|atol|atoll|atof|strtok|tmpnam)[[:space:]]*\('
while IFS= read -r hit; do
	[ -n "$hit" ] || continue
	echo "$hit: banned function (use snprintf, ds_strlcpy, ds_parse_*, strtok_r)"
	bad=1
done < <(grep -nHE "$banned" $src | grep -vE '^\S+:[0-9]+:\s*(\*|//)' )

allowed_for() {
	case "$1" in
	common/*) echo "common" ;;
	kernels/*) echo "common kernels" ;;
	engine/*) echo "common kernels engine" ;;
	agent/*) echo "common kernels engine agent" ;;
	ctl/*) echo "common ctl" ;;
	*) echo "*" ;;
	esac
}
for f in $src; do
	allowed=$(allowed_for "$f")
	[ "$allowed" = "*" ] && continue
	while IFS=: read -r line inc; do
		dir=${inc%%/*}
		case " $allowed " in
		*" $dir "*) ;;
		*) echo "$f:$line: includes \"$inc\": $f may include only: $allowed"; bad=1 ;;
		esac
	done < <(grep -nE '^#include "[a-z_]+/' "$f" | sed -E 's/^([0-9]+):#include "([^"]+)".*/\1:\2/')
done

for f in $(grep -E '\.(c|cu)$' <<<"$src"); do
	head -1 "$f" | grep -q '^/\*' || { echo "$f:1: file does not open with a comment saying what it is for"; bad=1; }
done

if [ $bad -eq 0 ]; then
	echo "check: ok ($(wc -w <<<"$src") files)"
fi
exit $bad
