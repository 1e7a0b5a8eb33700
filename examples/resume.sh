#!/usr/bin/env bash
# Train a transformers Llama at 2 ranks, stop halfway, resume the same checkpoint at 1 and
# at 3 ranks, export the result for transformers, and load it there.
#
#   bash examples/resume.sh                  # about 75 s on 2 CPU cores
#   STEPS=20 bash examples/resume.sh         # shorter
#
# Anything in ARGS goes to every run of examples/finetune_hf.py (e.g. ARGS="--shard").
#
# With CUDA, torchshard gives each rank of a node a GPU of its own (NCCL); two ranks on one
# GPU fail. A run with more ranks than there are GPUs therefore goes to the CPU (gloo), the
# others use the GPUs: the checkpoints are the same whatever the device.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-200}
HALF=$((STEPS / 2))
RUN=${RUN:-runs/resume}
ARGS=${ARGS:-}
TRAIN="examples/finetune_hf.py --steps $STEPS $ARGS"
rm -rf "$RUN"

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
launch() { # launch N ARGS...: N ranks under torchrun, on the CPU if there are fewer GPUs
    local n=$1
    shift
    if ((GPUS > 0 && GPUS < n)); then
        echo "($n ranks, $GPUS GPU(s): this run uses the CPU and gloo)"
        CUDA_VISIBLE_DEVICES="" torchrun --standalone --nproc-per-node "$n" "$@"
    else
        torchrun --standalone --nproc-per-node "$n" "$@"
    fi
}

echo "== 2 ranks: steps 1-$HALF, then stop"
launch 2 $TRAIN --ckpt-dir "$RUN/w2" --stop-at "$HALF"
torchshard inspect "$RUN/w2"

# The same checkpoint, twice: each resume writes its own later checkpoints.
cp -r "$RUN/w2" "$RUN/w1"
cp -r "$RUN/w2" "$RUN/w3"

echo "== 1 rank (no launcher): steps $((HALF + 1))-$STEPS from step $HALF"
python $TRAIN --ckpt-dir "$RUN/w1" --resume

echo "== 3 ranks: steps $((HALF + 1))-$STEPS from step $HALF"
launch 3 $TRAIN --ckpt-dir "$RUN/w3" --resume

echo "== export for transformers, and load it there"
torchshard consolidate "$RUN/w3" "$RUN/model"
python - "$RUN/model" <<'PY'
import sys

import torch
import transformers

model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
prompt = torch.tensor([list(b"def ")])
out = model.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)
print(f"loaded {type(model).__name__} from {sys.argv[1]}; greedy sample:",
      repr(bytes(out[0].tolist()).decode("utf-8", "replace")))
PY
