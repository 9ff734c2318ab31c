#!/usr/bin/env bash
# The benchmark suite behind `make bench`: a throughput sweep, the goal workloads measured as
# medians of interleaved runs against ceilings measured in the same run, small-READ latency and the
# KV-shaped workload. Writes bench/results/{sweep.csv,goals.csv,results.md,throughput.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/kvbridge}
OUT=${OUT:-bench/results}
SWEEP_SECS=${SWEEP_SECS:-1}
GOAL_SECS=${GOAL_SECS:-2}
REPS=${REPS:-5}
# Loopback ratio goals: PAIRS windows of PAIR_SECS seconds each followed by one of the ceiling, in
# one `bench --ceiling --reps PAIRS` run (the working sets set up once), so that the two halves of
# a pair are a second apart, not seconds: this host's bandwidth flips between levels that far
# apart (docs/performance-notes.md, "Pairs a second apart").
PAIRS=${PAIRS:-10}
PAIR_SECS=${PAIR_SECS:-1}
# Submitting threads in the sweep: 1 keeps `make bench` within 10 minutes on 2 cores (each point
# populates two buffers of $BUF first); THREADS="1 2" adds the second.
THREADS=${THREADS:-1}
START=$SECONDS
# CPU time (clock ticks) of DAMON's kdamond threads, if the host runs them: their access sampling
# grows with the memory the benchmark touches and competes with it for the cores.
damon_pids() {
    local f c
    for f in /proc/[0-9]*/comm; do
        { read -r c < "$f"; } 2>/dev/null || continue
        [[ $c == kdamond* ]] && { f=${f#/proc/}; echo "${f%/comm}"; }
    done
    return 0
}
damon_ticks() {
    local t=0 p s f
    for p in $(damon_pids); do
        { read -r s < "/proc/$p/stat"; } 2>/dev/null || continue
        read -r -a f <<< "${s##*) }" # from the state on: utime and stime are the 12th and 13th
        t=$((t + f[11] + f[12]))
    done
    echo "$t"
}
DAMON_START=$(damon_ticks)
# Per side: larger than the last-level cache, as a KV pool is - 256 MiB, or 4x the cache where
# sysfs tells its size and that is more (hosts with 300+ MiB of L3 exist).
llc_kib=$(sed -n 's/^\([0-9]*\)K$/\1/p' /sys/devices/system/cpu/cpu0/cache/index3/size 2>/dev/null || true)
if [ -n "${llc_kib:-}" ] && [ $((llc_kib * 4)) -gt $((256 * 1024)) ]; then
    BUF=${BUF:-$(((llc_kib * 4 + 1023) / 1024))M}
fi
BUF=${BUF:-256M}
LANES=2          # kvbridge bench's default, and the TCP ceiling's connection count
# The TCP congestion control of every TCP run, ceiling and iperf3 cross-check alike: cubic where
# the kernel has it, unless KVB_TCP_CONGESTION names another (`KVB_TCP_CONGESTION=bbr make
# bench`). BBR on TCP's own pacing (no fq qdisc here) cost kvbridge's batches 20-30% across a
# veth pair against 5-10% for the raw stream (the pairs: docs/performance-notes.md, "Congestion
# control").
CC_SYSTEM=$(cat /proc/sys/net/ipv4/tcp_congestion_control 2>/dev/null || echo unknown)
if [ -z "${KVB_TCP_CONGESTION:-}" ] &&
    grep -qw cubic /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null; then
    export KVB_TCP_CONGESTION=cubic
fi
CC=${KVB_TCP_CONGESTION:-$CC_SYSTEM}
IPERF_CC=(${KVB_TCP_CONGESTION:+-C "$KVB_TCP_CONGESTION"})
mkdir -p "$OUT"

say() { if [ -t 2 ]; then printf '\r\033[K%s' "$*" >&2; else echo "$*" >&2; fi; }
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" | tail -n 1; }
# The median of the numbers on stdin.
median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print "nan"; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
# Three decimals: what the noise of a shared machine leaves meaningful.
round() { awk '{if ($1 == "nan" || $1 == "") print "nan"; else printf "%.3f\n", $1}'; }
run() { "$BIN" bench "$@" --json 2>/dev/null | tail -n 1; }
kvb_gbps() { run --loopback --buffer-size "$BUF" "$@" | field gbps; }
# A ceiling on the same working set: a raw TCP stream over $LANES connections, or the best copy
# (memcpy, rep movsb or streaming stores) with the copy path's 2 threads; TCP: one warm pass over the buffers, then
# the best of 6 windows (three syscall sizes in turn); copy: one warm pass, then the best of 4
# runs within the duration.
ceiling() { run --baseline "$1" --block-size "$2" --duration "$3" --buffer-size "$BUF" --lanes "$LANES" | field gbps; }

# ---- sweep ------------------------------------------------------------------------------------
# Each block size's ceiling is measured right before and right after that size's points (the
# better of the two counts), not once for the whole sweep: minutes apart, a shared machine's
# stream moved 3.2-7.0 GB/s, and one early low reading made later points read 1.7-1.9 of "their
# ceiling". A ratio above 1 still means the ceiling is wrong: results.md flags it.
blocks=(4K 16K 64K 256K 1M 4M)
read -r -a threads <<< "$THREADS"
total=$(( ${#blocks[@]} * 2 * 2 * 3 * ${#threads[@]} ))
echo "protocol,operation,block_size,batch_size,threads,gbps,ceiling,ceiling_gbps,ratio" > "$OUT/sweep.csv"
k=0
for proto in tcp shm; do
  if [ "$proto" = tcp ]; then ck=tcp; cn="raw socket"; else ck=copy; cn="best copy"; fi
  for b in "${blocks[@]}"; do
    say "ceiling ($cn) for $b blocks"
    c0=$(ceiling "$ck" "$b" "$SWEEP_SECS" | round)
    rows=()
    for op in read write; do
      for batch in 1 16 128; do
        for t in "${threads[@]}"; do
          k=$((k + 1))
          say "[$k/$total] $proto $op block $b batch $batch threads $t"
          g=$(kvb_gbps --protocol "$proto" --operation "$op" --block-size "$b" \
                --batch-size "$batch" --threads "$t" --duration "$SWEEP_SECS" | round)
          rows+=("$op $batch $t $g")
        done
      done
    done
    c1=$(ceiling "$ck" "$b" "$SWEEP_SECS" | round)
    c=$(awk -v a="$c0" -v b="$c1" 'BEGIN {printf "%.3f", (a + 0 > b + 0 ? a : b)}')
    for row in "${rows[@]}"; do
      read -r op batch t g <<< "$row"
      r=$(awk -v g="$g" -v c="$c" 'BEGIN {printf "%.3f", (c > 0 ? g / c : 0)}')
      echo "$proto,$op,$b,$batch,$t,$g,$cn,$c,$r" >> "$OUT/sweep.csv"
    done
  done
done

# ---- goals: medians of REPS interleaved pairs (kvbridge run, then its ceiling) -----------------
echo "goal,workload,kvbridge,ceiling,ratio,target,met,pair ratios,the same batches raw" > "$OUT/goals.csv"
# kvbridge's runs and their ceilings, in pairs: "RATIO LOW HIGH" - the median of the pairs' ratios
# (each pair measured within seconds of each other, so a slow stretch of this shared machine
# moves both) and their range.
pair_ratios() { # ks... -- cs...
    local ks=() cs=()
    while [ "$1" != -- ]; do ks+=("$1"); shift; done
    shift
    cs=("$@")
    for i in "${!ks[@]}"; do
        awk -v k="${ks[$i]}" -v c="${cs[$i]}" 'BEGIN {if (c > 0 && k != "nan" && k != "") printf "%.4f\n", k / c}'
    done | sort -g | awk '{a[NR] = $1} END {
        if (NR == 0) { print "0 0 0"; exit }
        m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
        printf "%.3f %.3f %.3f\n", m, a[1], a[NR]}'
}
verdict() { awk -v r="$1" -v t="$2" 'BEGIN {print (r > 1 ? "ceiling below kvbridge" : r >= t ? "yes" : "no")}'; }
# A goal: `ratio` against the ceiling of the path the run took (PAIRS pairs in one run), or `abs`
# (GB/s; REPS runs of GOAL_SECS, the median).
goal_pair() { # name workload target ratio|abs -- kvbridge args
    local name=$1 work=$2 target=$3 kind=$4; shift 5
    local ks=()
    if [ "$kind" = ratio ]; then # the run and its ceiling in turn, in one process (see PAIRS)
        say "goal $name: $PAIRS pairs of ${PAIR_SECS} s windows"
        local j km cm r lo hi
        j=$(run --loopback --buffer-size "$BUF" "$@" --ceiling --reps "$PAIRS" \
            --duration $((PAIRS * PAIR_SECS)))
        km=$(field pair_gbps <<< "$j" | round)
        cm=$(field ceiling_gbps <<< "$j" | round)
        r=$(field ratio <<< "$j" | round)
        lo=$(field ratio_min <<< "$j" | round)
        hi=$(field ratio_max <<< "$j" | round)
        # Over TCP each pair has a third window: the same batches through a raw request/response
        # program (`bench --baseline rpc`) - what one batch at a time costs without kvbridge.
        local raw=""
        if [ -n "$(field rpc_gbps <<< "$j")" ]; then
            raw="$(field rpc_gbps <<< "$j" | round) GB/s = $(field rpc_ratio <<< "$j" | round) of the ceiling; kvbridge $(field vs_rpc <<< "$j" | round) of it"
        fi
        echo "$name,$work,$km GB/s,$cm GB/s,$r,>= $target,$(verdict "$r" "$target"),$lo-$hi,$raw" >> "$OUT/goals.csv"
        return
    fi
    for i in $(seq "$REPS"); do
        say "goal $name: run $i/$REPS"
        ks+=("$(kvb_gbps "$@" --duration "$GOAL_SECS")")
    done
    local km met
    km=$(printf '%s\n' "${ks[@]}" | median | round)
    met=$(awk -v k="$km" -v t="$target" 'BEGIN {print (k >= t ? "yes" : "no")}')
    echo "$name,$work,$km GB/s,,,>= $target GB/s,$met,$(printf '%s\n' "${ks[@]}" | sort -g | sed -n '1p;$p' | round | paste -sd-) GB/s" >> "$OUT/goals.csv"
}
goal_pair tcp-1m-read "TCP 1 MiB blocks batch 32 READ" 0.90 ratio -- --protocol tcp --operation read --block-size 1M --batch-size 32
goal_pair tcp-1m-write "TCP 1 MiB blocks batch 32 WRITE" 0.90 ratio -- --protocol tcp --operation write --block-size 1M --batch-size 32
goal_pair tcp-64k "TCP 64 KiB blocks batch 128 READ" 0.85 ratio -- --protocol tcp --operation read --block-size 64K --batch-size 128
goal_pair tcp-4k "TCP 4 KiB blocks batch 128 READ" 2.5 abs -- --protocol tcp --operation read --block-size 4K --batch-size 128
goal_pair shm-64k "shm 64 KiB blocks batch 128 READ" 0.90 ratio -- --protocol shm --operation read --block-size 64K --batch-size 128
goal_pair shm-1m "shm 1 MiB blocks batch 32 WRITE" 0.90 ratio -- --protocol shm --operation write --block-size 1M --batch-size 32
# With busy polling (busy_poll_us, off by default): the 4 KiB batches pay a round trip each, and
# on a host whose sleeping threads wake slowly the wakes are most of it (README, "Busy
# polling").
BUSY_US=${BUSY_US:-200}
goal_pair tcp-4k-busy "TCP 4 KiB blocks batch 128 READ busy polling $BUSY_US us" 2.5 abs -- --protocol tcp --operation read --block-size 4K --batch-size 128 --busy-poll "$BUSY_US"

# iperf3, where installed, as a cross-check of the TCP ceiling (same connections, 1 MiB writes).
if command -v iperf3 >/dev/null; then
    say "iperf3 cross-check"
    port=$((20000 + RANDOM % 20000))
    iperf3 -s -1 -p "$port" -B 127.0.0.1 >/dev/null 2>&1 &
    sleep 0.5
    ip=$(iperf3 -c 127.0.0.1 -p "$port" "${IPERF_CC[@]}" -l 1M -P "$LANES" -t "$GOAL_SECS" -J 2>/dev/null | tr -d '\n' |
         sed -n 's/.*"sum_received"[^}]*"bits_per_second":[[:space:]]*\([0-9.e+]*\).*/\1/p')
    wait || true
    ic=$(ceiling tcp 1M "$GOAL_SECS" | round)
    echo "iperf3,iperf3 -l 1M -P $LANES (cross-check of the TCP ceiling),$(awk -v b="${ip:-0}" 'BEGIN {printf "%.3f", b / 8e9}') GB/s,$ic GB/s,,,," >> "$OUT/goals.csv"
fi

# Across two network namespaces joined by a veth pair (where this runs as root and may make
# them): a real interface with its own addresses instead of loopback. The ceiling there is the
# same raw TCP stream as on loopback, flowing the way the measured data does - a READ's from the
# target's namespace into the initiator's, a WRITE's back (`bench --baseline tcp --bind ADDR
# --peer-netns NS`: the receiver here, the sender in NS) - interleaved; iperf3 with the same
# connection count and direction (-R for a READ) runs between the same namespaces beside it, as a
# cross-check (it
# measured 1.9-2.4 GB/s where kvbridge moved 2.8-4.1: one thread and 1 MiB writes, no ceiling).
VETH_A=kvbb-a-$$ VETH_B=kvbb-b-$$ VETH_DIR=$(mktemp -d)
veth_cleanup() { # the namespaces' processes, then the namespaces (their veth ends go with them)
    for ns in "$VETH_A" "$VETH_B"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    done
    sleep 0.3
    for ns in "$VETH_A" "$VETH_B"; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "$VETH_DIR"
}
trap veth_cleanup EXIT
veth_goals() {
    command -v iperf3 >/dev/null && command -v ip >/dev/null || { echo "veth: skipped (no iperf3 or ip)" >&2; return 0; }
    local a=$VETH_A b=$VETH_B va=kvbva$$ vb=kvbvb$$ dir=$VETH_DIR
    ip netns add "$a" 2>/dev/null || { echo "veth: skipped (cannot create network namespaces)" >&2; return 0; }
    ip netns add "$b" && ip link add "$va" type veth peer name "$vb" &&
        ip link set "$va" netns "$a" && ip link set "$vb" netns "$b" &&
        ip -n "$a" addr add 10.203.7.1/24 dev "$va" && ip -n "$b" addr add 10.203.7.2/24 dev "$vb" &&
        ip -n "$a" link set "$va" up && ip -n "$b" link set "$vb" up &&
        ip -n "$a" link set lo up && ip -n "$b" link set lo up || { echo "veth: skipped (setup failed)" >&2; return 0; }
    # Each flow's packets onto one CPU's queue (RPS over every CPU), as a NIC's receive queues keep
    # a flow in order. Without it a veth end queues a packet on the CPU that sends it - the
    # sending thread's, or the one where the peer's ACKs are processed - and one flow sent from
    # two CPUs arrives out of order: 2026-11-24 (about 20:20), a 2 s WRITE of 1 MiB blocks retransmitted
    # 2500-11000 segments (84600 of them reported spurious by DSACK), at 1.3-1.7 GB/s; with RPS
    # 0-1 segments, at 3.3-4.5 (docs/performance-notes.md, "TCP over veth: reordering").
    local cpus mask
    cpus=$(nproc)
    [ "$cpus" -gt 31 ] && cpus=31 # one 32-bit word of the mask: enough to spread the flows
    mask=$(printf '%x' $(((1 << cpus) - 1)))
    ip netns exec "$a" sh -c "echo $mask > /sys/class/net/$va/queues/rx-0/rps_cpus" 2>/dev/null &&
        ip netns exec "$b" sh -c "echo $mask > /sys/class/net/$vb/queues/rx-0/rps_cpus" 2>/dev/null ||
        echo "veth: RPS not set (flows may arrive out of order)" >&2
    head -c 32 /dev/urandom > "$dir/secret"
    ip netns exec "$a" "$BIN" bench --mode target --bind 10.203.7.1 --buffer-size "$BUF" \
        --secret-file "$dir/secret" > "$dir/target.out" 2>&1 &
    local seg=""
    for _ in $(seq 100); do
        seg=$(sed -n 's/^target ready: segment \([^,]*\),.*/\1/p' "$dir/target.out")
        [ -n "$seg" ] && break
        sleep 0.1
    done
    [ -n "$seg" ] || { echo "veth: skipped (the target did not start: $(cat "$dir/target.out"))" >&2; return 0; }
    veth_pair() { # name workload target block -- kvbridge args
        local name=$1 work=$2 target=$3 block=$4; shift 5
        local ks=() cs=() is=() ps=() km cm im pm r rx_ns rx_addr tx_ns dir_read=0
        case " $* " in *" --operation read "*) dir_read=1 ;; esac
        local rev="" # iperf3's server sends (-R) where the target sends: a READ
        [ "$dir_read" = 1 ] && rev=-R
        for i in $(seq "$REPS"); do
            say "veth $name: run $i/$REPS"
            ks+=("$(ip netns exec "$b" "$BIN" bench --mode initiator --segment "$seg" \
                --secret-file "$dir/secret" --buffer-size "$BUF" --duration "$GOAL_SECS" "$@" \
                --json 2>/dev/null | tail -n 1 | field gbps)")
            # The raw stream goes the way the data does: a READ's from the target's namespace
            # into the initiator's (receiver there, sender in the target's), a WRITE's back.
            if [ "$dir_read" = 1 ]; then rx_ns=$b rx_addr=10.203.7.2 tx_ns=$a; else rx_ns=$a rx_addr=10.203.7.1 tx_ns=$b; fi
            cs+=("$(ip netns exec "$rx_ns" "$BIN" bench --baseline tcp --bind "$rx_addr" --peer-netns "$tx_ns" \
                --block-size "$block" --duration "$GOAL_SECS" --buffer-size "$BUF" --lanes "$LANES" \
                --json 2>/dev/null | tail -n 1 | field gbps)")
            local port=$((20000 + RANDOM % 20000))
            ip netns exec "$a" iperf3 -s -1 -p "$port" -B 10.203.7.1 >/dev/null 2>&1 &
            sleep 0.3
            is+=("$(ip netns exec "$b" iperf3 -c 10.203.7.1 -p "$port" "${IPERF_CC[@]}" -l 1M -P "$LANES" $rev \
                -t 1 -J 2>/dev/null | tr -d '\n' |
                sed -n 's/.*"sum_received"[^}]*"bits_per_second":[[:space:]]*\([0-9.e+]*\).*/\1/p' |
                awk '{printf "%.3f", $1 / 8e9}')")
            wait "$!" 2>/dev/null || true
            # The same batches through a raw request/response program, its server in the
            # target's namespace (3 runs of 1 s, and iperf3 1 s: make bench stays within 10
            # minutes).
            [ "$i" -le 3 ] && ps+=("$(ip netns exec "$b" "$BIN" bench --baseline rpc --bind 10.203.7.2 --peer-netns "$a" \
                --duration 1 --buffer-size "$BUF" --lanes "$LANES" "$@" --json 2>/dev/null | tail -n 1 | field gbps)")
        done
        km=$(printf '%s\n' "${ks[@]}" | median | round)
        cm=$(printf '%s\n' "${cs[@]}" | median | round)
        im=$(printf '%s\n' "${is[@]}" | median | round)
        pm=$(printf '%s\n' "${ps[@]}" | median | round)
        local lo hi pr kp
        read -r r lo hi < <(pair_ratios "${ks[@]}" -- "${cs[@]}")
        read -r pr _ _ < <(pair_ratios "${ps[@]}" -- "${cs[@]:0:${#ps[@]}}")
        read -r kp _ _ < <(pair_ratios "${ks[@]:0:${#ps[@]}}" -- "${ps[@]}")
        echo "$name,$work (veth; ceiling a raw stream across it; iperf3 -P $LANES: $im GB/s),$km GB/s,$cm GB/s,$r,>= $target,$(verdict "$r" "$target"),$lo-$hi,$pm GB/s = $pr of the ceiling; kvbridge $kp of it" >> "$OUT/goals.csv"
    }
    veth_pair veth-tcp-1m-read "TCP 1 MiB blocks batch 32 READ" 0.90 1M -- --protocol tcp --operation read --block-size 1M --batch-size 32
    veth_pair veth-tcp-1m-write "TCP 1 MiB blocks batch 32 WRITE" 0.90 1M -- --protocol tcp --operation write --block-size 1M --batch-size 32
    veth_pair veth-tcp-64k "TCP 64 KiB blocks batch 128 READ" 0.85 64K -- --protocol tcp --operation read --block-size 64K --batch-size 128
}
veth_goals
veth_cleanup

say "latency"
latency_goal() { # name label -- bench args
    local name=$1 label=$2 lat lr
    shift 3
    lat=$("$BIN" bench --loopback --latency --json "$@" 2>/dev/null | tail -n 1)
    lr=$(echo "$lat" | field ratio_p50)
    echo "$name,64 B READ round trip p50$label (p99 $(echo "$lat" | field lat_p99_us) us),$(echo "$lat" | field lat_p50_us) us,$(echo "$lat" | field raw_p50_us) us raw $(echo "$lat" | field raw_socket) ping-pong,$lr,<= 1.3,$(awk -v r="$lr" 'BEGIN {print (r <= 1.3 ? "yes" : "no")}')," >> "$OUT/goals.csv"
}
# The raw ping-pong's echo lingers as the target's progress thread does (linger_us, default 100).
latency_goal latency-64b "" --
latency_goal latency-64b-busy " busy polling $BUSY_US us (the ping-pong too)" -- --busy-poll "$BUSY_US"
# One `bench --kv` run of $REPS pulls, each paired with its ceiling: kv_goal NAME MODEL TOKENS
# PROTOCOL LABEL [bench options].
kv_goal() {
    local name=$1 model=$2 tokens=$3 proto=$4 label=$5 kv kr
    shift 5
    say "KV-shaped workload $model, $tokens tokens, over $proto$label"
    kv=$("$BIN" bench --kv "$model" --tokens "$tokens" --protocol "$proto" --reps "$REPS" --json "$@" 2>/dev/null | tail -n 1)
    kr=$(echo "$kv" | field ratio)
    echo "$name,$model $tokens tokens over $proto$label ($(echo "$kv" | field bytes) B),$(echo "$kv" | field median_ms) ms,$(echo "$kv" | field ceiling_gbps) GB/s ceiling,$kr,<= 1.15,$(awk -v r="$kr" 'BEGIN {print (r <= 0 ? "no" : r < 1 ? "ceiling below kvbridge" : r <= 1.15 ? "yes" : "no")}'),$(echo "$kv" | field ratio_min | round)-$(echo "$kv" | field ratio_max | round)" >> "$OUT/goals.csv"
}
for shape in "llama3-8b 4096" "llama3-70b 2048" "deepseek-v3 8192"; do
  set -- $shape
  for proto in tcp shm; do
    kv_goal "kv-$1-$proto" "$1" "$2" "$proto" ""
  done
done
# The MLA shape again with the engines' data threads on CPUs of their own (cpus, unbound by
# default; README, "CPUs for the data threads"): the first two CPUs this process may run on, the
# progress thread's and the copy thread's, as the copy ceiling's threads then are.
CPUS=$(awk '/^Cpus_allowed_list:/ {
    n = split($2, r, ","); k = 0
    for (i = 1; i <= n && k < 2; i++) {
        lo = r[i]; hi = r[i]; if (split(r[i], ab, "-") == 2) { lo = ab[1]; hi = ab[2] }
        for (c = lo + 0; c <= hi + 0 && k < 2; c++) { out = out (k ? "," : "") c; k++ }
    }
    if (k == 2) print out
}' /proc/self/status)
if [ -n "$CPUS" ]; then
    kv_goal kv-deepseek-v3-shm-cpus deepseek-v3 8192 shm " data threads on CPUs ${CPUS/,/ and }" --cpus "$CPUS"
fi
say ""

# ---- report -----------------------------------------------------------------------------------
{
    echo "# kvbridge benchmark results"
    echo
    llc=$(cat /sys/devices/system/cpu/cpu0/cache/index3/size 2>/dev/null || echo "unknown (sysfs has none)")
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -r). Command: \`make bench\`"
    echo "($(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s)."
    echo "Working set: $BUF per side; last-level cache: $llc. Ceilings: a raw loopback TCP stream"
    echo "over $LANES connections (sender and receiver each with a buffer of its own, populated after"
    echo "the fork; the receiver polling 100 us once bytes came, as kvbridge's initiator does for"
    echo "answers; one pass over the buffers not counted, then the best of three windows, one per"
    echo "syscall size in the pair not counted, then two in the size best so far and one in another),"
    echo "and the best of memcpy, rep movsb and streaming stores with the copy path's"
    echo "2 threads, bound to CPUs of their own, then unbound (with --cpus, on those CPUs; one pass"
    echo "not counted), between the run's own buffers for the goals (the pages its copies used; the"
    echo "sweep's separate ceiling runs copy between fresh memfd pages) - each measured in the process"
    echo "of the run it divides, in turn with it: $PAIRS windows of ${PAIR_SECS} s of the run, each"
    echo "followed by one of its ceiling as long, after one of each not counted. Across the veth pair"
    echo "(RPS over every CPU on both ends, so a flow arrives in order) the same raw stream the way"
    echo "the data flows (a READ's from the target's namespace into the initiator's), $REPS"
    echo "interleaved pairs of ${GOAL_SECS} s runs"
    echo "(the best of 6 windows per ceiling run). KV ceilings move the same blocks as the pull they"
    echo "divide, each pull's in source order (same-host ones between the pulls' own pools)."
    echo "TCP congestion control: $CC (KVB_TCP_CONGESTION; the system's default is $CC_SYSTEM), the"
    echo "same for kvbridge's connections, the raw streams and iperf3. The engines' progress threads"
    echo "linger ${KVB_LINGER_US:-100} us after requests (linger_us; the latency ping-pong's echo as long)."
    if [ -n "$(damon_pids)" ]; then
        echo "DAMON's kdamond ran beside it: $(awk -v t=$(( $(damon_ticks) - DAMON_START )) \
            -v hz="$(getconf CLK_TCK)" -v s=$((SECONDS - START)) 'BEGIN {printf "%.1f", s ? 100 * t / hz / s : 0}')% of one"
        echo "CPU over the run (its accessed-bit sampling; see docs/performance-notes.md, \"KV over TCP\")."
    fi
    echo
    echo "## Goals (loopback: $PAIRS pairs of ${PAIR_SECS} s windows, kvbridge then its ceiling)"
    echo
    echo "kvbridge and ceiling: the medians of the windows (veth: of the runs); ratio: the median of"
    echo "the pairs' ratios (the pairs' range beside it) - the halves of a pair a second apart, so a"
    echo "slow stretch of a shared machine moves both. GB/s rows: $REPS runs of ${GOAL_SECS} s, the"
    echo "median. KV rows: one \`bench --kv\` run of $REPS pulls, each"
    echo "followed by its ceiling over the same blocks (the best of windows as long as the pull,"
    echo "20-200 ms, about 0.6 s of them; the ceiling column their median), the ratio the median of"
    echo "the pulls' time over bytes / ceiling;"
    echo "latency: the bench's own interleaved rounds."
    echo
    echo "The same batches raw (TCP rows): a plain request/response program moving the run's batches"
    echo "one at a time over the same connections (\`bench --baseline rpc\`: a 16-byte request per"
    echo "connection, its share streamed back, or sent and acknowledged) - what one batch at a time"
    echo "costs the stream without kvbridge; loopback: each pair's third window (half as long),"
    echo "medians; veth: 3 runs of 1 s after the first 3 pairs, set against those pairs."
    echo
    echo "| goal | workload | kvbridge | ceiling | ratio | pairs | target | met | the same batches raw |"
    echo "|---|---|---|---|---|---|---|---|---|"
    tail -n +2 "$OUT/goals.csv" | awk -F, '{printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $8, $6, $7, $9}'
    echo
    echo "## Sweep (${SWEEP_SECS} s per point; ratio = kvbridge / ceiling for the same block size)"
    echo
    echo "| protocol | op | block | batch | threads | GB/s | ceiling | ceiling GB/s | ratio |"
    echo "|---|---|---|---|---|---|---|---|---|"
    tail -n +2 "$OUT/sweep.csv" | awk -F, '{r = ($9 + 0 > 1 ? $9 " (ceiling below kvbridge)" : $9); printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, r}'
    flagged=$(tail -n +2 "$OUT/sweep.csv" | awk -F, '$9 + 0 > 1' | wc -l)
    if [ "$flagged" -gt 0 ]; then
        echo
        echo "$flagged point(s) moved more than the ceiling measured beside them: that ceiling was"
        echo "wrong for them (a slow stretch of the machine during its window), not a figure to believe."
    fi
} > "$OUT/results.md"

if command -v gnuplot >/dev/null; then
    for proto in tcp shm; do
        for op in read write; do
            awk -F, -v p="$proto" -v o="$op" '$1==p && $2==o && $4==128 && $5==1 {print $3, $6, $8}' \
                "$OUT/sweep.csv" | sed 's/K / * 1024 /; s/M / * 1048576 /' |
                awk '{split($0, a, " "); v = a[1] * (a[3] == "" ? 1 : a[3]); print v, a[4], a[5]}' \
                > "$OUT/.plot-$proto-$op.dat"
        done
    done
    gnuplot <<GP
set terminal pngcairo size 1000,600 noenhanced
set output "$OUT/throughput.png"
set title "kvbridge loopback throughput (batch 128, 1 thread) and ceilings"
set logscale x 2
set xlabel "block size"
set format x "%.0b%B"
set ylabel "GB/s"
set key outside right
set grid
plot "$OUT/.plot-tcp-read.dat" using 1:2 with linespoints title "tcp read", \
     "$OUT/.plot-tcp-write.dat" using 1:2 with linespoints title "tcp write", \
     "$OUT/.plot-tcp-read.dat" using 1:3 with lines dashtype 2 title "raw socket", \
     "$OUT/.plot-shm-read.dat" using 1:2 with linespoints title "shm read", \
     "$OUT/.plot-shm-write.dat" using 1:2 with linespoints title "shm write", \
     "$OUT/.plot-shm-read.dat" using 1:3 with lines dashtype 3 title "best copy (2 threads)"
GP
    rm -f "$OUT"/.plot-*.dat
fi
echo "wrote $OUT/sweep.csv $OUT/goals.csv $OUT/results.md $OUT/throughput.png in $((SECONDS - START)) s" >&2
cat "$OUT/goals.csv" | column -t -s, >&2 || true
