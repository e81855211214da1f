#!/usr/bin/env bash
# up.sh - `make up`: serve the model on this machine in the foreground.
#
# Starts dsagent on 127.0.0.1 (OpenAI API on $DS_API_PORT, default 8000;
# control API on $DS_CONTROL_PORT, default 7481) with its data directory under
# the project (run/data), serving $DS_MODEL or the embedded default model,
# makes sure there is an API key (kept in run/api.key, mode 0600, reused while
# the agent still accepts it), prints it with ready-to-paste curl and OpenAI
# SDK examples, and waits.  Ctrl-C stops dsagent cleanly.  A second `make up`
# while one runs is refused by dsagent (it names the running one's pid) and
# leaves the running one's files alone, its log (run/dsagent.out) included.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DATA=run/data
API_PORT=${DS_API_PORT:-8000}
CONTROL_PORT=${DS_CONTROL_PORT:-7481}
MODEL_ARGS=()
[ -n "${DS_MODEL:-}" ] && MODEL_ARGS=(--model "$DS_MODEL")
mkdir -p "$DATA"
chmod 700 run "$DATA"

# dsagent's stdout goes to a new file that becomes run/dsagent.out only once
# dsagent holds the data directory (it prints its listening line after
# taking the lock): a refused second start never empties the running
# agent's log.
LOG=run/dsagent.out
NEW=$(mktemp run/dsagent.out.XXXXXX)
OUT=$NEW
"$BUILD/dsagent" --config examples/dsagent.conf --bind 127.0.0.1 \
	--control-port "$CONTROL_PORT" --api-bind 127.0.0.1 --api-port "$API_PORT" \
	--data-dir "$DATA" "${MODEL_ARGS[@]}" >"$NEW" &
PID=$!
stop() {
	trap - INT TERM
	echo
	echo "stopping dsagent (pid $PID) ..."
	kill -TERM "$PID" 2>/dev/null || true
	wait "$PID" || true
	[ "$OUT" = "$NEW" ] && rm -f "$NEW"
	exit 0
}
trap stop INT TERM

for _ in $(seq 600); do # up to 60 s for the model to load
	if [ "$OUT" = "$NEW" ] && grep -q '^dsagent listening ' "$NEW"; then
		mv -f "$NEW" "$LOG" # past the lock: the log is ours
		OUT=$LOG
	fi
	grep -q '^dsagent serving model=' "$OUT" && break
	if ! kill -0 "$PID" 2>/dev/null; then
		[ "$OUT" = "$NEW" ] && rm -f "$NEW"
		echo "dsagent exited before it was ready (see the messages above)" >&2
		exit 1
	fi
	sleep 0.1
done
MODEL=$(sed -n 's/^dsagent serving model=//p' "$OUT")
[ -n "$MODEL" ] || { echo "dsagent did not become ready in 60 s" >&2; stop; }

CTL=("$BUILD/dsctl" --agent "http://127.0.0.1:$CONTROL_PORT" --data-dir "$DATA")
KEY=""
if [ -s run/api.key ]; then
	KEY=$(cat run/api.key)
	code=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $KEY" \
		-H 'Content-Type: application/json' -d '{"prompt":"hi"}' \
		"http://127.0.0.1:$API_PORT/tokenize" || true)
	[ "$code" = 200 ] || KEY=""
fi
if [ -z "$KEY" ]; then
	KEY=$("${CTL[@]}" --json keys create "make-up-$(date +%Y%m%d-%H%M%S)" |
		sed -n 's/.*"key": *"\([^"]*\)".*/\1/p')
	[ -n "$KEY" ] || { echo "could not create an API key" >&2; stop; }
	(umask 077 && printf '%s\n' "$KEY" >run/api.key)
fi

cat <<MSG

dsagent is serving '$MODEL' on http://127.0.0.1:$API_PORT (data in $DATA).
API key (also in run/api.key):

  $KEY

Try, in another shell:

  curl http://127.0.0.1:$API_PORT/v1/chat/completions \\
    -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \\
    -d '{"model":"$MODEL","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":64,"temperature":0}'

  .venv/bin/python -c 'from openai import OpenAI
c = OpenAI(base_url="http://127.0.0.1:$API_PORT/v1", api_key="$KEY")
r = c.chat.completions.create(model="$MODEL", messages=[{"role": "user", "content": "Hello!"}],
                              max_tokens=64, temperature=0)
print(r.choices[0].message.content)'

  $BUILD/dsctl --agent http://127.0.0.1:$CONTROL_PORT --data-dir $DATA keys list

Ctrl-C stops it.
MSG
wait "$PID"
