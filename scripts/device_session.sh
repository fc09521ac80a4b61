#!/usr/bin/env bash
# One call on a lent GPU machine: what the card and torch are, every mechanism against itself on
# the CPU (scripts/device_check.py), then GPU timings of the paths that do not go through flex
# plus flex's local window. Each stage has its own time limit and writes its rows as they finish,
# so a stage cut short still leaves what it measured.
#
#     OUT=/some/dir bash scripts/device_session.sh
set -u
export PYTHONPATH=src
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv; $PY -c 'import torch, sys; print(torch.__version__, sys.version)'; } \
    > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${CHECK_S:-210}" $PY scripts/device_check.py --device "${DEVICE:-cuda}" --seconds 25 --out "$OUT/device-check.jsonl" \
    > "$OUT/device-check.log" 2>&1
echo "device_check rc=$? rows=$(wc -l < "$OUT/device-check.jsonl")"
grep -v '"status": "ok"' "$OUT/device-check.jsonl" | cut -c1-300
mechanisms=(linear performer rfa gla deltanet lsh sinkhorn routing nsa moba "local:left=256,right=256")
timeout "${SPEED_S:-200}" $PY -m attnzoo.cli bench speed --device "${DEVICE:-cuda}" ${mechanisms[@]/#/--mechanism } \
    --n 4096,16384 --causal both --repeats 5 --out "$OUT/speed.jsonl" > "$OUT/speed.log" 2>&1
echo "speed rc=$? rows=$(wc -l < "$OUT/speed.jsonl")"
tail -5 "$OUT/speed.log"
