"""The playground entry point. The Gradio page comes with the playground issue; until then this streams a demo.

    python app.py [--model PATH_OR_ID] [--prompt TEXT]
"""
from __future__ import annotations

import argparse
import sys

from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder, hub id or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--prompt", default="In two sentences, what does a KV cache do in a language model?")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    print("The Gradio playground is not built yet; streaming one chat reply from the real engine instead.\n")
    llm = LLM(args.model)
    engine = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
    shown = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.text[shown:])
                sys.stdout.flush()
                shown = len(out.text)
    snap = engine.snapshot()
    m = out.metrics
    print(f"\n\n[{len(out.token_ids)} tokens, finish={out.finish_reason}, TTFT {m.ttft * 1e3:.0f} ms, "
          f"TPOT {(m.tpot or 0) * 1e3:.1f} ms, {snap.step} engine steps, KV blocks free again: "
          f"{snap.kv_blocks_used == 0}]")


if __name__ == "__main__":
    main()
