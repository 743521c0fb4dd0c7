#!/usr/bin/env bash
# GPU check of the nccl path of train.py (needs 1+ CUDA GPU and the nccl backend; not run on CPU CI).
#
#   bash ddp_tutorial/lessons/beyond_one_machine/workers/gpu_check.sh            # from the repository root
#
# 1. A 1-rank nccl run: --backend auto must pick nccl, the rank must use cuda:0.
# 2. A checkpoint resume on the GPU: a run stopped mid-epoch (injected exit at micro-step 7,
#    after the save at micro-step 6), resumed from its checkpoint (loaded with
#    map_location=cuda:0), must end with the parameters of an uninterrupted GPU run.
# Prints "gpu check: ok" and exits 0 on success; anything else is a failure.
set -euo pipefail
PY=${PYTHON:-python}
OUT=${GPU_CHECK_DIR:-$(mktemp -d -t ddp-gpu-check-XXXXXX)}
ARGS=(--dataset-size 256 --batch-size 16 --accum-steps 2 --epochs 2 --threads 0)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
echo "gpu check: results in $OUT"

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible"
assert torch.distributed.is_nccl_available(), "this torch build has no nccl"
print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PYEOF

# 1. uninterrupted nccl run (also the reference for the resume)
timeout 300 "${TORCHRUN[@]}" -m ddp_tutorial.train "${ARGS[@]}" --backend auto --out "$OUT/reference" \
    | tee "$OUT/reference.log"
grep -q "backend=nccl device=cuda:0" "$OUT/reference.log"

# 2. stopped after micro-step 6 (the last save), then resumed from the checkpoint
if timeout 300 "${TORCHRUN[@]}" -m ddp_tutorial.train "${ARGS[@]}" --out "$OUT/stopped" \
        --checkpoint "$OUT/ckpt.pt" --save-every 3 --fail-at-step 7 --fail-mode exit; then
    echo "gpu check: the injected failure did not stop the run" >&2; exit 1
fi
timeout 300 "${TORCHRUN[@]}" -m ddp_tutorial.train "${ARGS[@]}" --out "$OUT/resumed" \
    --checkpoint "$OUT/ckpt.pt" --save-every 3 | tee "$OUT/resumed.log"
grep -q "resumed from .* step 6" "$OUT/resumed.log"

"$PY" - "$OUT" <<'PYEOF'
import sys
import torch
from ddp_tutorial.rank.checkpoint import load_checkpoint
out = sys.argv[1]
ckpt = load_checkpoint(f"{out}/ckpt.pt", map_location="cuda:0")
assert all(t.device.type == "cuda" for t in ckpt["model"].values()), "map_location did not apply"
ref = torch.load(f"{out}/reference/model.pt", map_location="cpu", weights_only=True)
res = torch.load(f"{out}/resumed/model.pt", map_location="cpu", weights_only=True)
worst = max((ref[k] - res[k]).abs().max().item() for k in ref)
print(f"max |resumed - uninterrupted| = {worst:.3g}")
assert worst < 1e-5, "the resumed GPU run does not end where the uninterrupted one does"
PYEOF
echo "gpu check: ok"
