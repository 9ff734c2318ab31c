#!/usr/bin/env bash
# Compares two kvbridge binaries on the same machine: interleaved runs of `kvbridge bench
# --loopback` (old, new, old, new, ...) for each path, block size and operation, then the median
# GB/s of each and new/old. Usage: bench/compare.sh OLD_BIN NEW_BIN [RUNS] [SECONDS]
set -euo pipefail
old=$1 new=$2 runs=${3:-5} secs=${4:-2}
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
gbps() { "$1" bench --loopback --duration "$secs" --protocol "$2" --block-size "$3" \
    --batch-size 32 --operation "$4" --json 2>/dev/null | tail -1 |
    sed -n 's/.*"gbps":\([0-9.e+-]*\).*/\1/p'; }
printf '%-5s %-6s %-6s %10s %10s %8s\n' path block op old_GB/s new_GB/s new/old
for proto in tcp shm; do
    for block in 64K 1M; do
        for op in read write; do
            o=() n=()
            for ((i = 0; i < runs; i++)); do
                o+=("$(gbps "$old" "$proto" "$block" "$op")")
                n+=("$(gbps "$new" "$proto" "$block" "$op")")
            done
            mo=$(printf '%s\n' "${o[@]}" | median)
            mn=$(printf '%s\n' "${n[@]}" | median)
            printf '%-5s %-6s %-6s %10.3f %10.3f %8.3f\n' "$proto" "$block" "$op" "$mo" "$mn" \
                "$(awk -v a="$mn" -v b="$mo" 'BEGIN {print a / b}')"
        done
    done
done
