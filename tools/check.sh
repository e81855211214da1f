#!/usr/bin/env bash
# check.sh - `make check`: style rules that a compiler does not enforce.
#
#  1. banned functions (unbounded or unchecked): strcpy strcat sprintf vsprintf
#     gets atoi atol atoll atof strtok tmpnam
#  2. include direction: common <- kernels <- comm <- engine <- worker, agent;
#     rooms inside agent/ by the table below; ctl may include common/ and
#     ctl/ only; tests may include anything
#  3. every .c/.cc/.cu file opens with a comment saying what it is for
#  4. every repository path that README.md or docs/*.md names exists: tokens
#     that start with a top-level directory of the tree (common/ ... docs/)
#     or are Makefile / README.md; a brace form a/b.{c,h} names both, a glob
#     must match something; URLs, absolute paths and ../shared/... are not
#     repository paths, build/ run/ models/ .venv are made, not committed
# Prints each finding as file:line: message and exits non-zero if any.
set -uo pipefail
cd "$(dirname "$0")/.."
bad=0
src=$(git ls-files -co --exclude-standard -- '*.c' '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null)

banned='\b(strcpy|strcat|sprintf|vsprintf|gets|atoi|atol|atoll|atof|strtok|tmpnam)[[:space:]]*\('
while IFS= read -r hit; do
	[ -n "$hit" ] || continue
	echo "$hit: banned function (use snprintf, ds_strlcpy, ds_parse_*, strtok_r)"
	bad=1
done < <(grep -nHE "$banned" $src | grep -vE '^\S+:[0-9]+:\s*(\*|//)' )

# The layers, lowest first: common <- kernels <- comm <- engine <- worker, agent.
# Inside agent/ each room may include the rooms listed for it; agent/ itself
# (main.c, options.c: the start-up order) and agent/api may include every room.
# An include "agent/ROOM/x.h" counts as "agent/ROOM", "agent/x.h" as "agent".
allowed_for() {
	case "$1" in
	common/*) echo "common" ;;
	kernels/*) echo "common kernels" ;;
	comm/*) echo "common kernels comm" ;;
	engine/*) echo "common kernels comm engine" ;;
	worker/*) echo "common kernels comm engine worker" ;;
	agent/node/*) echo "common agent/node" ;;
	agent/store/*) echo "common agent/store" ;;
	agent/auth/*) echo "common agent/store agent/auth" ;;
	agent/cluster/*) echo "common agent/node agent/store agent/auth agent/cluster agent/plan" ;;
	agent/launch/*) echo "common agent/launch" ;;
	agent/plan/*) echo "common kernels comm engine agent/plan" ;;
	agent/api/*) echo "common kernels engine agent/node agent/store agent/auth agent/cluster agent/launch agent/api" ;;
	agent/*/*) echo "(no rule for this room: add it to tools/check.sh)" ;;
	agent/*) echo "common kernels comm engine worker agent agent/node agent/store agent/auth agent/cluster agent/api agent/plan agent/launch" ;;
	ctl/*) echo "common ctl" ;;
	*) echo "*" ;;
	esac
}
unit_of() { # the layer or agent room an include path names
	case "$1" in
	agent/*/*) echo "${1%/*}" ;;
	*) echo "${1%%/*}" ;;
	esac
}
for f in $src; do
	allowed=$(allowed_for "$f")
	[ "$allowed" = "*" ] && continue
	while IFS=: read -r line inc; do
		dir=$(unit_of "$inc")
		case " $allowed " in
		*" $dir "*) ;;
		*) echo "$f:$line: includes \"$inc\": $f may include only: $allowed"; bad=1 ;;
		esac
	done < <(grep -nE '^#include "[a-z_]+/' "$f" | sed -E 's/^([0-9]+):#include "([^"]+)".*/\1:\2/')
done

for f in $(grep -E '\.(c|cc|cu)$' <<<"$src"); do
	head -1 "$f" | grep -q '^/\*' || { echo "$f:1: file does not open with a comment saying what it is for"; bad=1; }
done

# Rule 4.  awk prints FILE:LINE:PATH for each candidate (a token not glued
# to a preceding path or URL character), braces expanded; the shell checks.
doc_paths() {
	awk '
	function emit(tok,   i, j, pre, alts, post, n, k, a) {
		sub(/[.,:;]+$/, "", tok)
		i = index(tok, "{")
		if (i == 0) { print FILENAME ":" FNR ":" tok; return }
		j = index(tok, "}")
		if (j < i) return
		pre = substr(tok, 1, i - 1); alts = substr(tok, i + 1, j - i - 1)
		post = substr(tok, j + 1)
		n = split(alts, a, ",")
		for (k = 1; k <= n; k++) emit(pre a[k] post)
	}
	{
		line = $0
		top = "(common|kernels|comm|engine|worker|agent|ctl|tests|tools|schema|systemd|examples|docs)"
		re = "(^|[^A-Za-z0-9_./:~-])(" top "/[A-Za-z0-9_./*-]*(\\{[A-Za-z0-9_.,-]*\\}[A-Za-z0-9_./-]*)?|Makefile|README\\.md)"
		while (match(line, re)) {
			tok = substr(line, RSTART, RLENGTH)
			if (tok !~ /^[A-Za-z]/) tok = substr(tok, 2)
			rest = substr(line, RSTART + RLENGTH)
			if (rest !~ /^[A-Za-z0-9_]/) emit(tok)
			line = rest
		}
	}' README.md docs/*.md
}
while IFS=: read -r doc line path; do
	case "$path" in
	*'*'*) compgen -G "$path" >/dev/null && continue ;;
	*) [ -e "$path" ] && continue ;;
	esac
	echo "$doc:$line: names $path, which does not exist"
	bad=1
done < <(doc_paths)

if [ $bad -eq 0 ]; then
	echo "check: ok ($(wc -w <<<"$src") files)"
fi
exit $bad
