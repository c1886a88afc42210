#!/bin/bash
# vLLM's CPU server and the engine beside k busy processes (`while True: pass`), driven by vLLM's own client:
# c=8, 16 prompts of 64 random tokens, 48 output tokens (ignore_eos), greedy, fp32; output tok/s per k, over the
# same server's quiet run (k=0) and against the fair share 2/(2+k) (docs/measurements.md, "Against vLLM's own client").
#     bash tools/peer_beside_busy.sh ENGINE_CHECKOUT [OUT_DIR]
# env: VLLM_VENV (/tmp/venv-vllm), MODEL (the engine's converted SmolLM2 folder under ~/.cache/watch-llm),
#      SERVERS ("engine vllm vllm-2cores": vLLM at its default binding, and bound to both cores), KS ("0 1 2 4 6"),
#      ROUNDS (2), DTYPE (float32), TIMEOUT (seconds a run may take beside busy processes, 600), PYTHON (python3),
#      PORT (8011).
# Each server is started, warmed, measured over ROUNDS x KS and stopped before the next starts; busy processes start
# after the warm-up and are killed after each run, whatever happens. Put it under the machine's measuring lock with
# `flock -o` (the servers would otherwise inherit the lock's descriptor and hold it for as long as they live).
engine=$(cd "${1:?usage: $0 ENGINE_CHECKOUT [OUT_DIR]}" && pwd) || exit 1
out=${2:-$(mktemp -d)}; mkdir -p "$out"; out=$(cd "$out" && pwd)
venv=${VLLM_VENV:-/tmp/venv-vllm}; model=${MODEL:-$(ls -d ~/.cache/watch-llm/SmolLM2-*/ | head -1)}
port=${PORT:-8011}; servers=${SERVERS:-engine vllm vllm-2cores}; ks=${KS:-0 1 2 4 6}; rounds=${ROUNDS:-2}; dtype=${DTYPE:-float32}
busy=(); group=
stop_busy() { [ ${#busy[@]} -gt 0 ] && { kill "${busy[@]}"; wait "${busy[@]}"; } 2>/dev/null; busy=(); }
stop_server() { [ -n "$group" ] && { kill -CONT -- "-$group"; kill -TERM -- "-$group"; sleep 5; kill -KILL -- "-$group"; } 2>/dev/null; group=; }
trap 'stop_busy; stop_server' EXIT; trap 'exit 130' INT TERM
# Job control: each server its own process group (to pause and stop it whole), but in this session, so the busy
# processes share its autogroup; a server in a session of its own (setsid) would get half the CPU whatever k is,
# Linux's autogroup sharing the CPU between sessions before threads
set -m

source "$(dirname "$0")/peer_servers.sh"  # start LABEL PORT
bench() {  # OUT.json CONCURRENCY PROMPTS SEED
  timeout "${TIMEOUT:-600}" "$venv/bin/vllm" bench serve --backend openai --endpoint /v1/completions \
    --base-url http://127.0.0.1:$port --model smollm2 --tokenizer "$model" --dataset-name random \
    --random-input-len 64 --random-output-len 48 --ignore-eos --temperature 0 --max-concurrency "$2" \
    --num-prompts "$3" --request-rate inf --seed "$4" --save-result --result-dir "$out" --result-filename "$1" \
    > "$out/${1%.json}.log" 2>&1
}

for s in $servers; do
  start "$s" "$port" > "$out/$s-server.log" 2>&1 & group=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/v1/models > /dev/null && break; sleep 2; done
  bench "$s-warmup.json" 8 16 "$RANDOM" || echo "$s: warm-up failed (see $out/$s-server.log)"
  for r in $(seq "$rounds"); do for k in $ks; do
    sleep 3
    for _ in $(seq "$k"); do "${PYTHON:-python3}" -c 'while True: pass' & busy+=($!); done
    sleep 2  # the engine reads the cores' load every half second
    bench "$s-k$k-r$r.json" 8 16 "$RANDOM$RANDOM" || echo "$s k=$k round $r: failed or timed out"
    stop_busy
    echo "$s k=$k round $r: load $(cut -d' ' -f1 /proc/loadavg)"
  done; done
  stop_server
done

"${PYTHON:-python3}" - "$out" $servers <<'EOF'
import json, pathlib, re, sys
out, servers = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {}
for f in out.glob("*-k*-r*.json"):
    s, k, r = re.fullmatch(r"(.+)-k(\d+)-r(\d+)\.json", f.name).groups()
    runs.setdefault(s, {}).setdefault(int(k), {})[int(r)] = json.loads(f.read_text())["output_throughput"]
print("| beside k | fair share 2/(2+k) | " + " | ".join(f"{s} tok/s | {s} / its k=0" for s in servers) + " |")
print("|---:|---:|" + "---:|---:|" * len(servers))
rng = lambda v: f"{min(v):.1f}-{max(v):.1f}" if len(v) > 1 else f"{v[0]:.1f}"
for k in sorted({k for s in runs.values() for k in s}):
    cells = []
    for s in servers:
        got, quiet = runs.get(s, {}).get(k, {}), runs.get(s, {}).get(0, {})
        ratio = [got[r] / quiet[r] for r in got if quiet.get(r)]
        cells += [rng(sorted(got.values())) if got else "-", f"{min(ratio):.2f}-{max(ratio):.2f}" if ratio else "-"]
    print(f"| {k} | {2 / (2 + k):.2f} | " + " | ".join(cells) + " |")
EOF
