#!/bin/bash
# The peer table: the engine, vLLM's CPU server at its default binding and vLLM bound to both cores, driven by vLLM's
# own client (`vllm bench serve`: random 128-token prompts, 64 tokens out with ignore_eos, num-prompts max(16, 4C)),
# per cell and round; output tok/s, TTFT and TPOT, and the engine's ratios over each vLLM (docs/measurements.md,
# "Against vLLM's own client"; the recipe in ../shared/PEERS.md).
#     bash tools/peer_table.sh DTYPE OUT_DIR ROUND...        e.g. bash tools/peer_table.sh float32 /tmp/pt 1 2
# env: CELLS ("1g 1t 8g 32g": concurrency, then g greedy / t temperature 1), VLLM_VENV (/tmp/venv-vllm), MODEL (the
#      engine's converted SmolLM2 folder under ~/.cache/watch-llm), ENGINE (this checkout), PYTHON (python3),
#      PORT (8011: the engine; +1 vLLM, +2 vLLM on both cores), TIMEOUT (600 s a run).
# The three servers are up together, each warmed (c=8 and c=32, 16 tokens out); all but the one measured are paused
# (SIGSTOP), the servers' order rotates every cell, and each cell and round has a fresh seed (the same prompts to all
# three). Put it under the machine's measuring lock with `flock -o` (the servers would otherwise hold the lock).
dtype=${1:?usage: $0 DTYPE OUT_DIR ROUND...}; out=${2:?usage: $0 DTYPE OUT_DIR ROUND...}; shift 2
rounds=("${@:-1}"); mkdir -p "$out"; out=$(cd "$out" && pwd)
engine=$(cd "${ENGINE:-$(dirname "$0")/..}" && pwd) || exit 1
venv=${VLLM_VENV:-/tmp/venv-vllm}; model=${MODEL:-$(ls -d ~/.cache/watch-llm/SmolLM2-*/ | head -1)}
port=${PORT:-8011}; cells=${CELLS:-1g 1t 8g 32g}; servers=(engine vllm vllm-2cores)
declare -A group pport=([engine]=$port [vllm]=$((port + 1)) [vllm-2cores]=$((port + 2)))
stop_all() { local x g; for x in "${servers[@]}"; do g=${group[$x]}; [ -n "$g" ] && { kill -CONT -- "-$g"; kill -TERM -- "-$g"; } 2>/dev/null; done
             sleep 5; for x in "${servers[@]}"; do g=${group[$x]}; [ -n "$g" ] && kill -KILL -- "-$g" 2>/dev/null; done; }
trap stop_all EXIT; trap 'exit 130' INT TERM
set -m  # job control: each server its own process group, to pause and stop it whole (in this session's autogroup)

source "$(dirname "$0")/peer_servers.sh"  # start LABEL PORT
bench() {  # SERVER OUT.json CONCURRENCY TEMPERATURE SEED [OUTPUT_LEN]
  local c=$3; timeout "${TIMEOUT:-600}" "$venv/bin/vllm" bench serve --backend openai --endpoint /v1/completions \
    --base-url "http://127.0.0.1:${pport[$1]}" --model smollm2 --tokenizer "$model" --dataset-name random \
    --random-input-len 128 --random-output-len "${6:-64}" --ignore-eos --temperature "$4" --max-concurrency "$c" \
    --num-prompts $((c * 4 > 16 ? c * 4 : 16)) --request-rate inf --seed "$5" --save-result --result-dir "$out" \
    --result-filename "$2" > "$out/${2%.json}.log" 2>&1
}
only() { local x; for x in "${servers[@]}"; do kill "-$([ "$x" = "$1" ] && echo CONT || echo STOP)" -- "-${group[$x]}"; done; sleep 2; }

for s in "${servers[@]}"; do start "$s" "${pport[$s]}" > "$out/$s-server.log" 2>&1 & group[$s]=$!; done
for s in "${servers[@]}"; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:${pport[$s]}/v1/models" > /dev/null && break; sleep 2; done
done
for s in "${servers[@]}"; do
  only "$s"; for c in 8 32; do bench "$s" "warmup-$s-$c.json" $c 0 1 16 || echo "$s: warm-up failed ($out/$s-server.log)"; done
done
turn=0
for r in "${rounds[@]}"; do for cell in $cells; do
  c=${cell%[gt]}; temp=$([ "${cell: -1}" = t ] && echo 1 || echo 0); seed=$RANDOM$RANDOM
  for i in 0 1 2; do
    s=${servers[$(((turn + i) % 3))]}; only "$s"
    bench "$s" "$s-$cell-r$r.json" "$c" "$temp" "$seed" || echo "$s $cell round $r: failed or timed out"
    echo "$s $cell round $r: load $(cut -d' ' -f1 /proc/loadavg)"
  done; turn=$((turn + 1))
done; done

"${PYTHON:-python3}" - "$out" "$dtype" <<'EOF'
import json, pathlib, re, sys
out, dtype = pathlib.Path(sys.argv[1]), sys.argv[2]
runs = {}
for f in out.glob("*-r*.json"):
    m = re.fullmatch(r"(engine|vllm|vllm-2cores)-(\d+[gt])-r(\w+)\.json", f.name)
    if m:
        runs.setdefault(m[2], {}).setdefault(m[1], {})[m[3]] = json.loads(f.read_text())
rng = lambda v, f="{:.1f}": (f.format(min(v)) + "-" + f.format(max(v))) if len(v) > 1 else f.format(v[0]) if v else "-"
def col(cell, s, key):
    return [r[key] for r in runs[cell].get(s, {}).values()]
def ratio(cell, peer, key="output_throughput"):
    e, p = runs[cell].get("engine", {}), runs[cell].get(peer, {})
    return rng([e[r][key] / p[r][key] for r in e if r in p and p[r][key]], "{:.2f}x")
print(f"| {dtype}, output tok/s | engine | vLLM 1 core | vLLM 2 cores | engine / vLLM 1 core | / vLLM 2 cores "
      "| TPOT ms engine / vLLM 1 core / 2 cores | TTFT ms engine / vLLM 1 core / 2 cores |")
print("|---|---:|---:|---:|---:|---:|---|---|")
order = lambda cell: (int(cell[:-1]), cell[-1])
for cell in sorted(runs, key=order):
    name = f"c={cell[:-1]} {'greedy' if cell[-1] == 'g' else 'temperature 1'}"
    tok = [rng(col(cell, s, "output_throughput")) for s in ("engine", "vllm", "vllm-2cores")]
    tpot = " / ".join(rng(col(cell, s, "median_tpot_ms")) for s in ("engine", "vllm", "vllm-2cores"))
    ttft = " / ".join(rng(col(cell, s, "median_ttft_ms"), "{:.0f}") for s in ("engine", "vllm", "vllm-2cores"))
    print(f"| {name} | " + " | ".join(tok) + f" | {ratio(cell, 'vllm')} | {ratio(cell, 'vllm-2cores')} | {tpot} | {ttft} |")
EOF
