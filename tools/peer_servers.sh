# Sourced by tools/peer_table.sh and tools/peer_beside_busy.sh: how each server starts on 127.0.0.1, answering to
# the name "smollm2". Uses the caller's engine (a checkout), venv (vLLM's), model (the converted folder) and dtype.
start() {  # LABEL PORT: engine, vllm (its default binding) or vllm-2cores (bound to both cores)
  case $1 in
    engine) cd "$engine" && GRADIO_SERVER_PORT=$2 exec "${PYTHON:-python3}" app.py --served-model-name smollm2 \
              --set max_num_seqs=32 --set "dtype=$dtype" ;;
    vllm) VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 exec "$venv/bin/vllm" serve "$model" --port "$2" \
            --host 127.0.0.1 --dtype "$dtype" --served-model-name smollm2 ;;
    vllm-2cores) VLLM_CPU_OMP_THREADS_BIND=0-1 start vllm "$2" ;;
  esac
}
