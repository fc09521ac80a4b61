#!/usr/bin/env bash
# One call on a lent GPU machine: what the card and torch are, every mechanism against itself on
# the CPU (scripts/device_check.py), then GPU timings against dense SDPA of what has not been timed
# there as a default: the non-causal kernel mechanisms in one block of rows off the CPU
# (kernel.DEVICE_BLOCK_BYTES; A/B'd by scripts/ab_device_block_rows.py in the fourth session, not
# yet run through `bench speed`), and the content-based mechanisms launch-bound at 4K (lsh,
# sinkhorn, routing) causal and not. Each stage has its own time limit and writes its rows as they
# finish, so a stage cut short still leaves what it measured. The check took 250 s on an H100
# (92 checks, fourth session); the three stages fit in ~8 minutes.
#
#     OUT=/some/dir bash scripts/device_session.sh
#     (env: DEVICE=cuda, PY=python3, N=4096,16384, ONLY=<mechanisms to check>, *_S = seconds)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
N=${N:-4096,16384}
{ nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --format=%h; $PY -c 'import torch, sys; print(torch.__version__, sys.version)'; } \
    > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${CHECK_S:-260}" $PY scripts/device_check.py --device "$DEVICE" --seconds 25 --only "${ONLY:-}" \
    --out "$OUT/device-check.jsonl" > "$OUT/device-check.log" 2>&1
echo "device_check rc=$? rows=$(wc -l < "$OUT/device-check.jsonl")"
grep -v '"status": "ok"' "$OUT/device-check.jsonl" | cut -c1-400

speed() {  # speed NAME SECONDS ARGS...: one bench speed run into $OUT/NAME.jsonl
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" $PY -m attnzoo.cli bench speed --device "$DEVICE" --n "$N" --repeats 5 "$@" \
        --out "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? rows=$(grep -c '"kind": "speed"' "$OUT/$name.jsonl")"
    tail -4 "$OUT/$name.log"
}
speed speed-kernel "${KERNEL_S:-90}" --mechanism performer --mechanism efficient --mechanism linear --causal no
speed speed-content "${CONTENT_S:-150}" --mechanism lsh --mechanism sinkhorn --mechanism routing --causal both
