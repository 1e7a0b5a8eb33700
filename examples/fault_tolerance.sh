#!/usr/bin/env bash
# A worker is killed mid-run; torchrun restarts the job, which resumes from the last
# checkpoint; later the run continues at another world size. The final weights are
# compared, bit for bit, with the same schedule run without the fault.
#
#   bash examples/fault_tolerance.sh              # about 20 s on 2 CPU cores
#   STEPS=40 KILL=25 bash examples/fault_tolerance.sh
#
# The recipe is the launch line: `torchrun --max-restarts N` plus a script that resumes
# from its latest checkpoint when restarted (train_gpt.py does: --resume, or
# TORCHELASTIC_RESTART_COUNT > 0).
#
# It runs on the CPU (gloo) even where there are GPUs: the check at the end is bitwise, which
# needs deterministic kernels (not every GPU kernel is), and the 3-rank runs would need 3 GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_VISIBLE_DEVICES=""

STEPS=${STEPS:-60}
HALF=$((STEPS / 2))
KILL=${KILL:-$((HALF * 2 / 3 + 1))}  # between two checkpoints
RUN=${RUN:-runs/faults}
TRAIN="examples/train_gpt.py --preset tiny --block-size 32 --batch-size 12 --steps $STEPS
       --save-every 5 --log-every 10 --threads 1 --num-workers 1 --lr 1e-2"
rm -rf "$RUN"

echo "== without a fault: 2 ranks to step $HALF, then 3 ranks to step $STEPS"
torchrun --standalone --nproc-per-node 2 $TRAIN --ckpt-dir "$RUN/clean" --stop-at "$HALF"
torchrun --standalone --nproc-per-node 3 $TRAIN --ckpt-dir "$RUN/clean" --resume

echo "== with a fault: rank 1 is killed after step $KILL; torchrun restarts both workers"
torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
    $TRAIN --ckpt-dir "$RUN/faulty" --stop-at "$HALF" --fail-at "$KILL"
echo "== and resumes at 3 ranks, as above"
torchrun --standalone --nproc-per-node 3 $TRAIN --ckpt-dir "$RUN/faulty" --resume

echo "== the final weights"
python - "$RUN" "$STEPS" <<'PY'
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

run, steps = Path(sys.argv[1]), int(sys.argv[2])
final = f"step-{steps:08d}"
clean, faulty = ({} for _ in range(2))
for d, out in ((run / "clean" / final, clean), (run / "faulty" / final, faulty)):
    for f in sorted(d.glob("model*.safetensors")):
        out.update(load_file(f))
same = clean.keys() == faulty.keys() and all(torch.equal(clean[k], faulty[k]) for k in clean)
print(f"final weights equal the uninterrupted run's: {same} ({len(clean)} tensors, bitwise)")
sys.exit(0 if same else 1)
PY
