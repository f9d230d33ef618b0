#!/usr/bin/env bash
# bash examples/mcp_judge/run.sh [trajlab run options, e.g. --set rl.steps=1]      (from the repository root)
#
# Starts the stand-in judge (judge_server.py) on a free loopback port, runs `trajlab run` on config.yaml with the
# judge's URL and this machine's paths of the MCP server and of its Python packages, stops the judge, and says where
# the report is. RUN_DIR (default runs/mcp_judge) is the run directory. To grade with a real model, leave out the
# stand-in and give the judge's URL yourself:
#   --set rl.rewards.judge.args.url=http://HOST:PORT/v1#MODEL
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
run_dir="${RUN_DIR:-runs/mcp_judge}"
python="${PYTHON:-python}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"   # examples.mcp_judge.* (rewards, the demonstrator)

# The sandboxed server runs on the system's Python and imports mcp from this environment's packages, read-only.
site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

mkdir -p "$run_dir"
port_file="$run_dir/judge.port"
rm -f "$port_file"
"$python" "$here/judge_server.py" --port-file "$port_file" --log "$run_dir/judge-requests.jsonl" &
judge=$!
trap 'kill "$judge" 2>/dev/null; wait "$judge" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  [[ -s "$port_file" ]] && break
  kill -0 "$judge" 2>/dev/null || { echo "error: the stand-in judge did not start" >&2; exit 1; }
  sleep 0.1
done
[[ -s "$port_file" ]] || { echo "error: the stand-in judge did not start within 10 s" >&2; exit 1; }
echo "stand-in judge on http://127.0.0.1:$(cat "$port_file")/v1 (requests: $run_dir/judge-requests.jsonl)"

"$python" -m trajlab.cli run "$here/config.yaml" --run-dir "$run_dir" \
  --set "mcp.command=[/usr/bin/python3, $here/server.py]" \
  --set "mcp.env={PYTHONPATH: $site}" \
  --set "mcp.read_only_paths=[$here, $site]" \
  --set "rl.rewards.judge.args.url=http://127.0.0.1:$(cat "$port_file")/v1" \
  "$@"

echo "report: $run_dir/report.html"
