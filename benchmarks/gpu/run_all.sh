#!/usr/bin/env bash
# Every GPU benchmark within one 10-minute command on a lent H100 (benchmarks/gpu/README.md): installs the carried
# wheels (.whl/, made here by fetch_wheels.sh), checks the imports, then runs gpt2_pretrain.py and lora_gemma3_1b.py,
# each under its own time limit, and leaves their JSON and one log under $OUT. A jaxtune side that fails with cuDNN
# attention is run again with XLA attention if time is left. Each script writes its JSON after every side, so a
# script cut off by its time limit still leaves the sides it finished. `run_all.sh --tiny` is the same at the
# scripts' tiny shapes: a rehearsal on any machine (about two minutes on 2 CPU cores).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/jaxtune-gpu-bench}
mkdir -p "$OUT"
LOG=$OUT/run_all.log
BUDGET=${BUDGET:-575}  # seconds for everything (the device tool stops a command at 600)
exec > >(tee -a "$LOG") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "${1:-}" = --tiny ]; then GPT2=(--tiny); LORA=(--tiny); else GPT2=(--batch 64); LORA=(); fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "no nvidia-smi"
python3 - <<'EOF' || { echo "preflight failed: see README.md (wheels, versions)"; exit 1; }
import importlib.metadata as m, jax
names = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "torch", "transformers", "peft",
         "torchax", "pydantic", "grain", "numpy"]
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
print({n: v for n in names if (v := version(n))})
print("jax devices:", jax.devices())
import jaxtune.backends, jaxtune.train.step  # noqa: E401,F401 - the benchmark's import path
from jaxtune.backends.torchax.compat import import_torchax
import_torchax()
import torch, transformers, peft  # noqa: E401,F401
print("torch sees:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
EOF

left() { echo $((BUDGET - SECONDS)); }
failed_jax() {  # did the jaxtune side of this JSON end without a result?
  python3 -c "import json,sys; r={x['side']: x for x in json.load(open('$1'))['rows']}; j=r.get('jaxtune', {}); \
sys.exit(0 if j.get('error') or j.get('oom') else 1)" 2>/dev/null
}

timeout 240 python3 benchmarks/gpu/gpt2_pretrain.py "${GPT2[@]}" --json "$OUT/gpt2_pretrain.json"
timeout $(( $(left) > 60 ? $(left) - 60 : 1 )) python3 benchmarks/gpu/lora_gemma3_1b.py "${LORA[@]}" \
  --json "$OUT/lora_gemma3_1b.json"

if failed_jax "$OUT/gpt2_pretrain.json" && [ "$(left)" -gt 90 ]; then
  echo "=== gpt2: jaxtune with cuDNN attention failed; again with XLA attention"
  timeout $(( $(left) - 30 )) python3 benchmarks/gpu/gpt2_pretrain.py "${GPT2[@]}" --sides jaxtune --attention xla \
    --json "$OUT/gpt2_pretrain_xla.json"
fi
if failed_jax "$OUT/lora_gemma3_1b.json" && [ "$(left)" -gt 90 ]; then
  echo "=== lora: jaxtune native with cuDNN attention failed; again with XLA attention"
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu/lora_gemma3_1b.py "${LORA[@]}" --sides jaxtune --attention xla \
    --json "$OUT/lora_gemma3_1b_xla.json"
fi
echo "run_all: ${SECONDS}s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
