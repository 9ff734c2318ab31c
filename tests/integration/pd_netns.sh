#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# PD across "hosts": the prefill, the decode and the proxy each run in a network namespace of
# their own, joined through veth pairs to a bridge in a fourth ("switch") namespace, so every KV
# byte and every HTTP call crosses a real link (the same-host shared-memory path cannot: its
# abstract Unix socket is per namespace). Checks, against a colocated instance beside the client:
#   1. pull and push: answers (streamed and not) identical token for token;
#   2. the decode's link cut while its KV pull is in flight (the link is rate-limited with tbf so
#      that the pull lasts seconds): the client gets an HTTP error with a JSON error body within
#      the liveness deadline (the proxy's keepalive on its call to the decode; the request's own
#      deadline is far later), and the prefill's and the decode's KV blocks all come back free;
#   3. the link restored: new requests are served again, still identical.
# `tc netem` adds delay and loss on every link where the kernel has it; where it does not, the test
# runs without them and says so. Exits 77 (skipped, with the reason) where namespaces cannot be
# made. Everything it creates - namespaces, interfaces (inside them only), processes, files - is
# removed on every exit, including failure, interruption and its own watchdog.
#
# usage: pd_netns.sh KVBRIDGE_BINARY
set -u

bin=${1:-${KVB_BIN:-}}
limit_s=${KVB_NETNS_LIMIT_S:-150} # the watchdog, below CTest's TIMEOUT so that cleanup runs
tag=kvbns$$                       # namespaces are kvbnsPID-{sw,pre,dec,pxy}
sw=$tag-sw pre=$tag-pre dec=$tag-dec pxy=$tag-pxy
net=10.231.0 # private, and only inside this run's namespaces
pre_ip=$net.1 dec_ip=$net.2 pxy_ip=$net.3
model=tiny-gqa
tmp=
made_ns=

t_start=$(($(date +%s%N) / 1000000))
log() { echo "pd_netns: [$(($(date +%s%N) / 1000000 - t_start)) ms] $*"; }
fail() {
    log "FAILED: $*"
    for f in "$tmp"/*.log; do
        [ -s "$f" ] && { echo "---- ${f##*/} (last 30 lines)"; tail -n 30 "$f"; }
    done
    exit 1
}
skip() {
    log "SKIPPED: $*"
    exit 77
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# ---- cleanup -------------------------------------------------------------------------------------

# Kills every process inside namespace $1 (TERM, then KILL after 3 s) and deletes it. Deleting a
# namespace destroys the veth ends inside it, and so their peers and the bridge.
ns_remove() {
    local ns=$1 pids i
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
    for i in $(seq 30); do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -z "$pids" ] && break
        sleep 0.1
    done
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null && sleep 0.2
    ip netns delete "$ns" 2>/dev/null
}

cleanup() {
    trap - EXIT INT TERM HUP
    [ -n "${watchdog:-}" ] && kill "$watchdog" 2>/dev/null
    for ns in $made_ns; do
        ns_remove "$ns"
    done
    [ -n "$tmp" ] && rm -rf "$tmp"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 1' INT TERM HUP

# Namespaces and files of earlier runs that died without cleaning up (SIGKILL, a CTest timeout):
# their owner pid is in the name; only those whose owner is gone are removed.
sweep_leftovers() {
    local ns owner dir
    for dir in "${TMPDIR:-/tmp}"/kvb-netns.*.*; do
        owner=${dir##*/kvb-netns.}
        owner=${owner%%.*}
        [ -d "$dir" ] && [ "$dir" != "$tmp" ] && ! kill -0 "$owner" 2>/dev/null && rm -rf "$dir"
    done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^kvbns[0-9]+-(sw|pre|dec|pxy)$'); do
        owner=${ns#kvbns}
        owner=${owner%%-*}
        if ! kill -0 "$owner" 2>/dev/null; then
            log "removing $ns, left behind by run $owner"
            ns_remove "$ns"
        fi
    done
}

# ---- preconditions -------------------------------------------------------------------------------

[ -n "$bin" ] && [ -x "$bin" ] || fail "usage: pd_netns.sh KVBRIDGE_BINARY (got '${bin}')"
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces (running as uid $(id -u))"
for c in ip curl timeout; do # (tc is optional: netem and tbf)
    command -v "$c" >/dev/null || skip "'$c' is not installed (iproute2, curl and coreutils needed)"
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-netns.$$.XXXXXX") || fail "mktemp"
sweep_leftovers
# What the test runs in the namespaces dies with it even if it is SIGKILLed.
deathsig=()
setpriv --help 2>/dev/null | grep -q -- --pdeathsig && deathsig=(setpriv --pdeathsig KILL --)

# The watchdog's sleep is its own child: killed with it, so that no `sleep` outlives the test.
(
    trap 'kill $s 2>/dev/null; exit 0' TERM
    sleep "$limit_s" &
    s=$!
    wait $s
    # Only while the test is still its parent: a pid freed by a SIGKILLed test may be reused.
    me=$BASHPID
    [ "$(cut -d' ' -f4 "/proc/$me/stat")" = $$ ] || exit 0
    log "watchdog: still running after ${limit_s} s"
    kill -TERM $$
) &
watchdog=$!

# ---- the network ---------------------------------------------------------------------------------

for ns in $sw $pre $dec $pxy; do
    if ! err=$(ip netns add "$ns" 2>&1); then
        [ "$ns" = "$sw" ] && skip "cannot create a network namespace: $err"
        fail "ip netns add $ns: $err"
    fi
    made_ns="$made_ns $ns"
done
# The bridge and the switch-side veth ends live in $sw, the host ends (all named eth0) in each
# host's namespace: no name is visible outside this run, so parallel runs cannot collide.
run() { "$@" >"$tmp/cmd.out" 2>&1 || fail "$* : $(cat "$tmp/cmd.out")"; }
run ip -n "$sw" link add br0 type bridge
run ip -n "$sw" link set br0 up
link() { # link NS SWITCH_PORT ADDR
    run ip -n "$sw" link add "$2" type veth peer name eth0 netns "$1"
    run ip -n "$sw" link set "$2" master br0 up
    run ip -n "$1" addr add "$3/24" dev eth0
    run ip -n "$1" link set eth0 up
    run ip -n "$1" link set lo up
}
link "$pre" vpre "$pre_ip"
link "$dec" vdec "$dec_ip"
link "$pxy" vpxy "$pxy_ip"

# netem on the switch side of each link: every packet towards a host is delayed and may be lost.
netem_args="delay 3ms 1ms loss 0.5%"
netem=0
if command -v tc >/dev/null && err=$(tc -n "$sw" qdisc add dev vpre root netem $netem_args 2>&1); then
    run tc -n "$sw" qdisc add dev vdec root netem $netem_args
    run tc -n "$sw" qdisc add dev vpxy root netem $netem_args
    netem=1
    log "netem on every link: $netem_args"
else
    why=${err:-tc is not installed}
    log "NOTE: netem SKIPPED - 'tc qdisc add ... netem' failed here ($(echo $why)); the kernel" \
        "lacks sch_netem (CONFIG_NET_SCH_NETEM). The links run without added delay and loss."
fi

# ---- the instances -------------------------------------------------------------------------------

# Non-loopback engines must know the cluster secret: a fresh one per run, readable by root only.
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/secret")

declare -A url
start() { # start NAME NS ARGS...: runs `kvbridge ARGS` in NS, output in $tmp/NAME.log
    local name=$1 ns=$2
    shift 2
    ip netns exec "$ns" "${deathsig[@]}" "$bin" "$@" >"$tmp/$name.log" 2>&1 &
    eval "pid_$name=$!"
}
# Waits (30 s at most: the machine may be loaded) for NAME's ready line and reads its URL.
ready() {
    local name=$1 pid u i
    eval "pid=\$pid_$name"
    for i in $(seq 300); do
        u=$(grep -o -m1 'on http://[0-9.]*:[0-9]*' "$tmp/$name.log" | sed 's/^on //')
        [ -n "$u" ] && { url[$name]=$u; return 0; }
        kill -0 "$pid" 2>/dev/null || fail "$name exited before it was ready"
        sleep 0.1
    done
    fail "$name not ready after 30 s"
}
serve() { # serve NAME NS ADDR ROLE TP MODE [ARGS...]
    local name=$1 ns=$2 addr=$3 role=$4 tp=$5 mode=$6
    shift 6
    start "$name" "$ns" serve --role "$role" --model "$model" --tp "$tp" --port 0 --bind "$addr" \
        --kv-mode "$mode" --secret-file "$tmp/secret" "$@"
}

# A lease far longer than the peer timeout: blocks freed after a cut were freed by liveness.
serve pre_pull "$pre" "$pre_ip" prefill 2 pull --lease-ms 60000
serve dec_pull "$dec" "$dec_ip" decode 1 pull
serve pre_push "$pre" "$pre_ip" prefill 2 push
serve dec_push "$dec" "$dec_ip" decode 1 push
# The reference: one colocated instance on the client's (the proxy's) loopback.
start colo "$pxy" serve --role both --model "$model" --tp 1 --port 0
for n in pre_pull dec_pull pre_push dec_push colo; do ready $n; done
for m in pull push; do
    start "pxy_$m" "$pxy" proxy --prefill "${url[pre_$m]}" --decode "${url[dec_$m]}" --port 0 \
        --bind "$pxy_ip" --kv-mode "$m" --secret-file "$tmp/secret" # it signs its /pd/ calls
done
for m in pull push; do ready "pxy_$m"; done
log "prefill $pre_ip ($pre), decode $dec_ip ($dec), proxy and client $pxy_ip ($pxy)"

# In namespace NS: `curl ARGS` with a time limit.
ncurl() { local ns=$1; shift; ip netns exec "$ns" "${deathsig[@]}" curl -s --max-time 25 "$@"; }
health_field() { # health_field NS URL FIELD: an integer field of URL/health, read from inside NS
    ncurl "$1" "$2/health" | grep -o "\"$3\":[0-9]*" | head -1 | cut -d: -f2
}
# loadgen from the client's namespace through proxy MODE, every answer compared with the colocated
# instance's; fails unless all N succeed and none differs.
compare() { # compare MODE N PROMPT_LEN [--stream]
    local out
    out=$(ip netns exec "$pxy" "${deathsig[@]}" timeout 60 "$bin" loadgen --url "${url[pxy_$1]}" \
        --compare "${url[colo]}" --concurrency 2 --requests "$2" --prompt-len "$3" \
        --max-tokens 16 --timeout-ms 20000 ${4:-} 2>&1)
    local rc=$?
    echo "$out" >>"$tmp/loadgen.log"
    local line
    line=$(echo "$out" | grep '^compare')
    [ $rc -eq 0 ] && echo "$line" | grep -q "^compare *$2 compared .* 0 differ, 0 reference errors" ||
        fail "$1 ${4:-} prompt $3: loadgen exit $rc: $(echo "$out" | grep -v '^ ' | tr '\n' ' ')"
    log "$1 ${4:+streamed }prompt $3: $2/$2 identical to colocated"
}

# ---- 1. outputs across the namespaces ------------------------------------------------------------

for m in pull push; do
    compare $m 4 300
    compare $m 4 100 --stream
done

# ---- 2. the decode's link cut while its pull is in flight ----------------------------------------

total=$(health_field "$pre" "${url[pre_pull]}" total_blocks)
dtotal=$(health_field "$dec" "${url[dec_pull]}" total_blocks)
[ -n "$total" ] && [ -n "$dtotal" ] || fail "no total_blocks in the instances' /health"
# About 3 MiB of KV (769 tokens of 4 KiB) through an 8 Mbit/s port: a pull of 3 s or more.
[ $netem = 1 ] && root_op=replace || root_op=add
tbf=1
if ! err=$(tc -n "$sw" qdisc $root_op dev vdec root tbf rate 8mbit burst 32kb latency 1s 2>&1); then
    tbf=0
    log "NOTE: tbf unavailable ($err): the cut may land after the pull"
fi
prompt=$(head -c 768 /dev/zero | tr '\0' 'k')
tx() { ip netns exec "$sw" cat /sys/class/net/vdec/statistics/tx_bytes; }
# The request's own deadline ("timeout_ms"): far past the liveness deadlines (5 s), so an error
# in time proves the cut was detected, not merely waited out.
deadline_ms=30000
live_ms=10000 # the proxy's keepalive judges the decode lost within ~5 s; the rest is margin
tx0=$(tx)
t0=$(now_ms)
ip netns exec "$pxy" "${deathsig[@]}" curl -s --max-time 45 -o "$tmp/cut.body" -w '%{http_code}' \
    -d "{\"prompt\": \"$prompt\", \"max_tokens\": 8, \"timeout_ms\": $deadline_ms}" \
    "${url[pxy_pull]}/v1/completions" >"$tmp/cut.code" 2>"$tmp/cut.err" &
client=$!
# In flight: KV bytes are passing the decode's port (more than any HTTP body would be).
moved=0
while [ $((moved = $(tx) - tx0)) -lt 262144 ]; do
    kill -0 $client 2>/dev/null || fail "the request ended before its pull was seen: HTTP $(cat "$tmp/cut.code")"
    [ $(($(now_ms) - t0)) -gt $((deadline_ms + 2000)) ] && fail "no KV bytes towards the decode by the deadline"
    sleep 0.02
done
run ip -n "$sw" link set vdec down
t_cut=$(now_ms)
leases=$(health_field "$pre" "${url[pre_pull]}" leases)
dheld=$((dtotal - $(health_field "$dec" "${url[dec_pull]}" free_blocks)))
log "decode's link cut $((t_cut - t0)) ms into the request, $moved bytes of ~3.1 MB through;" \
    "then the prefill held $leases lease(s), the decode $dheld block(s)"
if [ $tbf = 1 ]; then
    [ "$leases" = 1 ] || fail "the prefill held $leases leases at the cut (expected 1)"
    [ "$dheld" -gt 0 ] || fail "the decode held no blocks at the cut"
fi

# Until the client has its answer and both instances have every block free again, or 20 s: the
# prefill's blocks come back once its engine declares the decode lost (its peer timeout, 5 s),
# long before its lease (60 s) would end them; the decode frees what the failed pull filled. Each
# /health is read from inside the instance's own namespace.
t_err= t_free= t_dfree=
while :; do
    now=$(now_ms)
    [ -z "$t_err" ] && [ -s "$tmp/cut.code" ] && t_err=$now # curl writes the status as it exits
    [ -z "$t_free" ] && [ "$(health_field "$pre" "${url[pre_pull]}" free_blocks)" = "$total" ] &&
        t_free=$now
    [ -z "$t_dfree" ] && [ "$(health_field "$dec" "${url[dec_pull]}" free_blocks)" = "$dtotal" ] &&
        t_dfree=$now
    [ -n "$t_err" ] && [ -n "$t_free" ] && [ -n "$t_dfree" ] && break
    [ $((now - t_cut)) -gt 20000 ] && break
    sleep 0.1
done
wait $client
code=$(cat "$tmp/cut.code")
body=$(cat "$tmp/cut.body")
[ -n "$t_err" ] || fail "no answer for the client 20 s after the cut"
log "client: HTTP $code after $((t_err - t0)) ms ($((t_err - t_cut)) ms after the cut): $body"
case $code in 5[0-9][0-9]) ;; *) fail "expected a 5xx for the cut request, got '$code' $(cat "$tmp/cut.err")" ;; esac
echo "$body" | grep -q '"error" *: *{.*"message" *: *"[^"]' || fail "no JSON error message: $body"
[ $((t_err - t_cut)) -le $live_ms ] ||
    fail "the error came $((t_err - t_cut)) ms after the cut, past the liveness deadline (${live_ms} ms)"
[ -n "$t_free" ] || fail "prefill: $(health_field "$pre" "${url[pre_pull]}" free_blocks) of $total blocks free 20 s after the cut"
log "prefill: all $total blocks free $((t_free - t_cut)) ms after the cut"
grep -h "freeing its blocks" "$tmp/pre_pull.log" | tail -1 | sed 's/^/pd_netns:   prefill log: /'
[ -n "$t_dfree" ] || fail "decode: $(health_field "$dec" "${url[dec_pull]}" free_blocks) of $dtotal blocks free 20 s after the cut"
log "decode: all $dtotal blocks free $((t_dfree - t_cut)) ms after the cut"

# ---- 3. the link restored ------------------------------------------------------------------------

if [ $netem = 1 ]; then
    run tc -n "$sw" qdisc replace dev vdec root netem $netem_args
elif [ $tbf = 1 ]; then
    run tc -n "$sw" qdisc del dev vdec root
fi
run ip -n "$sw" link set vdec up
compare pull 2 300
compare pull 2 768
log "link restored: served again; PASSED (netem $([ $netem = 1 ] && echo applied || echo skipped))"
exit 0
