#!/bin/sh
# callgrind.sh SCENARIO CONTENDER: Redis instructions per decision of one rate
# scenario's contender, counted by valgrind's callgrind inside the script commands
# (FCALL, EVALSHA, EVAL) of a redis-server of its own on 127.0.0.1. Unlike server
# time, the count does not move with the machine's load. Run in bench/, e.g.
#   ./callgrind.sh "rate: one hot key, denied" redis_rate
set -eu
scenario=$1 contender=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
go build -o "$dir/bench" .
valgrind --tool=callgrind --callgrind-out-file="$dir/out" \
  --toggle-collect=fcallCommand --toggle-collect=evalShaCommand --toggle-collect=evalCommand \
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >"$dir/log" 2>&1 &
vg=$!
i=0
until redis-cli -p "$port" ping >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -lt 150 ] || { echo "redis-server did not start" >&2; kill $vg; exit 1; }
  sleep 0.2
done
n=$(REDIS_ADDR=127.0.0.1:$port timeout 900 "$dir/bench" -only "$scenario" -contender "$contender" -callgrind $vg) || {
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; wait $vg || true; exit 1; }
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
wait $vg || true
total=$(callgrind_annotate "$dir/out" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1; exit }')
echo "$scenario | $contender | $((total / n)) instructions per decision ($n decisions)"
if [ -n "${CALLGRIND_KEEP:-}" ]; then cp "$dir/out" "$CALLGRIND_KEEP"; fi
