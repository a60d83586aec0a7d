#!/usr/bin/env bash
# benches/netem.sh: an emulated remote object store link for benchmarks.
#
# What it emulates: an S3-like store 10 ms RTT away whose throughput is capped PER TCP
# CONNECTION (100 MB/s on the wire by default, ~95 MB/s of payload), with no aggregate cap, so
# N parallel connections get about N times one connection, as with real S3. Striped parallel
# I/O can then be compared with a single GET/PUT on equal terms.
#
#   host (client)                 hs-link (the "network")                  hs-remote (server)
#   hs-host 198.18.77.1/30 <--veth--> hs-l0 .2   [delay, per-flow cap]   hs-l1 .5 <--veth--> hs-r0 198.18.77.6/30
#
# Run SeaweedFS in hs-remote (`netem.sh exec weed server -ip=198.18.77.6 ...`, or
# `SeaweedFs::start_in_netns("hs-remote", 198.18.77.6)` from hotstart-testkit), the client on
# the host, and address the server as 198.18.77.6. Traffic inside hs-remote (weed's master,
# volume and filer talking to each other) is not shaped; only the client<->server link is.
#
# How (this kernel has neither sch_netem nor sch_fq, and cannot load modules):
#   - Delay: every packet forwarded by hs-link goes to NFQUEUE 0 (iptables, mangle FORWARD);
#     scripts/netem_delay.py holds it DELAY_MS (default 5 ms) in the kernel and releases packets
#     in order with batch verdicts. Both directions are delayed, so the RTT is 2 x DELAY_MS.
#   - Per-flow cap: nftables in hs-link numbers each new connection (ct mark = numgen inc mod
#     256) and maps it to skb->priority = an HTB class 1:N on both egress interfaces; each of
#     the 256 classes is an independent leaf with rate = ceil = RATE_MBIT and a bfifo of one
#     bandwidth-delay product. Two live connections share a class only if 256 connections were
#     opened between them. Unclassified packets use class 1:ffff (same cap).
#   - Addresses come from 198.18.0.0/15, the range reserved for network benchmarks (RFC 2544),
#     so they clash with no real network. hs-link has no route beyond these two links, so
#     nothing in the namespaces can reach anything else.
#
# Usage (root):
#   benches/netem.sh up          create (idempotent: an intact link is left as it is)
#   benches/netem.sh down        remove everything (idempotent)
#   benches/netem.sh status      print the state; exit 1 if not fully up
#   benches/netem.sh exec CMD... run CMD inside hs-remote
#   benches/netem.sh ip          print the server address (198.18.77.6)
#   benches/netem.sh check       measure RTT and 1-flow vs 8-flow throughput (needs iperf3)
# Settings (for `up`): HS_NETEM_DELAY_MS (one way, default 5), HS_NETEM_RATE_MBIT (per flow,
# default 800 = 100 MB/s). Needs: iproute2 (ip, tc), nftables, iptables, python3 (stdlib only);
# scripts/setup.sh installs them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DELAY_MS="${HS_NETEM_DELAY_MS:-5}"
RATE_MBIT="${HS_NETEM_RATE_MBIT:-800}"
QUEUE_BDP="${HS_NETEM_QUEUE_BDP:-2}"
CHECK_SECONDS="${HS_NETEM_CHECK_SECONDS:-5}"
CLASSES=256
QUEUE=0

NS_LINK=hs-link
NS_REMOTE=hs-remote
DEV_HOST=hs-host # host end, host namespace
DEV_L0=hs-l0     # hs-link end toward the host
DEV_L1=hs-l1     # hs-link end toward the remote
DEV_REMOTE=hs-r0 # remote end, hs-remote
IP_HOST=198.18.77.1
IP_L0=198.18.77.2
IP_L1=198.18.77.5
IP_REMOTE=198.18.77.6
NET_HOST_SIDE=198.18.77.0/30
NET_REMOTE_SIDE=198.18.77.4/30

STATE_DIR=/run/hotstart-netem
DELAY_PID="$STATE_DIR/delay.pid"
DELAY_LOG="$STATE_DIR/delay.log"

say() { printf 'netem: %s\n' "$*"; }
die() {
    printf 'netem: error: %s\n' "$*" >&2
    exit 1
}

need_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, tc, nftables)"; }

ns_exists() { ip netns list 2>/dev/null | grep -w "^$1" >/dev/null; }

delay_alive() {
    local pid
    [ -f "$DELAY_PID" ] || return 1
    pid="$(cat "$DELAY_PID")"
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep netem_delay.py >/dev/null
}

is_up() {
    ns_exists "$NS_LINK" && ns_exists "$NS_REMOTE" && ip link show "$DEV_HOST" >/dev/null 2>&1 &&
        ip netns exec "$NS_LINK" nft list table inet hotstart_netem >/dev/null 2>&1 &&
        ip netns exec "$NS_LINK" tc qdisc show dev "$DEV_L0" | grep htb >/dev/null &&
        ip netns exec "$NS_LINK" tc qdisc show dev "$DEV_L1" | grep htb >/dev/null &&
        delay_alive
}

# One leaf class per flow slot on DEV's egress, written as a tc batch (fast).
shape() {
    local dev="$1" batch limit i h
    # QUEUE_BDP bandwidth-delay products of queue: rate (bytes/s) x RTT x QUEUE_BDP.
    limit=$((RATE_MBIT * 1000000 * 2 * DELAY_MS * QUEUE_BDP / 8000))
    [ "$limit" -ge 262144 ] || limit=262144
    batch="$(mktemp)"
    {
        echo "qdisc replace dev $dev root handle 1: htb default ffff"
        for i in $(seq 1 "$CLASSES") 65535; do
            h="$(printf %x "$i")"
            echo "class add dev $dev parent 1: classid 1:$h htb rate ${RATE_MBIT}mbit ceil ${RATE_MBIT}mbit burst 256k cburst 256k quantum 65536"
            echo "qdisc add dev $dev parent 1:$h bfifo limit $limit"
        done
    } >"$batch"
    ip netns exec "$NS_LINK" tc -batch "$batch"
    rm -f "$batch"
}

classify() {
    local map i
    map="$(for i in $(seq 1 "$CLASSES"); do printf '%d : 1:%x, ' "$i" "$i"; done)"
    ip netns exec "$NS_LINK" nft -f - <<EOF
table inet hotstart_netem
delete table inet hotstart_netem
table inet hotstart_netem {
    chain forward {
        type filter hook forward priority mangle; policy accept;
        # Number each new connection; every packet of it, both ways, uses that HTB class.
        ct state new ct mark set numgen inc mod $CLASSES offset 1
        meta priority set ct mark map { ${map%, } }
    }
}
EOF
}

queue_rule() {
    local ipt
    for ipt in iptables iptables-legacy; do
        command -v "$ipt" >/dev/null 2>&1 || continue
        if ip netns exec "$NS_LINK" "$ipt" -t mangle -C FORWARD -j NFQUEUE --queue-num "$QUEUE" 2>/dev/null ||
            ip netns exec "$NS_LINK" "$ipt" -t mangle -A FORWARD -j NFQUEUE --queue-num "$QUEUE" 2>/dev/null; then
            return 0
        fi
    done
    die "cannot add the NFQUEUE rule (iptables with the NFQUEUE target is needed)"
}

start_delay() {
    local python i
    python="$(command -v python3)" || die "python3 not found"
    mkdir -p "$STATE_DIR"
    ip netns exec "$NS_LINK" setsid "$python" "$ROOT/scripts/netem_delay.py" \
        --queue "$QUEUE" --delay-ms "$DELAY_MS" </dev/null >"$DELAY_LOG" 2>&1 &
    echo $! >"$DELAY_PID"
    for i in $(seq 1 50); do
        if grep -q ready "$DELAY_LOG" 2>/dev/null; then return 0; fi
        delay_alive || break
        sleep 0.1
    done
    cat "$DELAY_LOG" >&2 || true
    die "the delay line (scripts/netem_delay.py) did not start"
}

stop_delay() {
    if delay_alive; then
        kill "$(cat "$DELAY_PID")" 2>/dev/null || true
    fi
    rm -f "$DELAY_PID"
}

cmd_down() {
    need_root
    stop_delay
    ns_exists "$NS_REMOTE" && ip netns del "$NS_REMOTE"
    ns_exists "$NS_LINK" && ip netns del "$NS_LINK"
    # Deleting hs-link destroys its veth ends and so their peers; make sure anyway.
    if ip link show "$DEV_HOST" >/dev/null 2>&1; then ip link del "$DEV_HOST"; fi
    rm -rf "$STATE_DIR"
    say "down"
}

cmd_up() {
    need_root
    if is_up; then
        say "already up: server address $IP_REMOTE (RTT $((2 * DELAY_MS)) ms, ${RATE_MBIT} Mbit/s per flow)"
        return 0
    fi
    if ns_exists "$NS_LINK" || ns_exists "$NS_REMOTE" || ip link show "$DEV_HOST" >/dev/null 2>&1; then
        say "partly up; recreating"
        cmd_down >/dev/null
    fi
    command -v nft >/dev/null 2>&1 || die "nft not found (apt-get install nftables, or run scripts/setup.sh)"

    ip netns add "$NS_LINK"
    ip netns add "$NS_REMOTE"
    ip link add "$DEV_HOST" type veth peer name "$DEV_L0" netns "$NS_LINK"
    ip -n "$NS_LINK" link add "$DEV_L1" type veth peer name "$DEV_REMOTE" netns "$NS_REMOTE"

    sysctl -qw "net.ipv6.conf.$DEV_HOST.disable_ipv6=1" 2>/dev/null || true
    ip addr add "$IP_HOST/30" dev "$DEV_HOST"
    ip link set "$DEV_HOST" up
    ip route replace "$NET_REMOTE_SIDE" via "$IP_L0" dev "$DEV_HOST"

    ip -n "$NS_LINK" link set lo up
    ip -n "$NS_LINK" addr add "$IP_L0/30" dev "$DEV_L0"
    ip -n "$NS_LINK" addr add "$IP_L1/30" dev "$DEV_L1"
    ip -n "$NS_LINK" link set "$DEV_L0" up
    ip -n "$NS_LINK" link set "$DEV_L1" up
    ip netns exec "$NS_LINK" sysctl -qw net.ipv4.ip_forward=1

    ip -n "$NS_REMOTE" link set lo up
    ip -n "$NS_REMOTE" addr add "$IP_REMOTE/30" dev "$DEV_REMOTE"
    ip -n "$NS_REMOTE" link set "$DEV_REMOTE" up
    ip -n "$NS_REMOTE" route add "$NET_HOST_SIDE" via "$IP_L1" dev "$DEV_REMOTE"

    shape "$DEV_L0"
    shape "$DEV_L1"
    classify
    start_delay
    queue_rule
    say "up: server address $IP_REMOTE in namespace $NS_REMOTE (RTT $((2 * DELAY_MS)) ms, ${RATE_MBIT} Mbit/s per flow)"
}

cmd_status() {
    if is_up; then
        say "up: $IP_REMOTE in $NS_REMOTE; delay line pid $(cat "$DELAY_PID")"
        local qdiscs
        qdiscs="$(ip netns exec "$NS_LINK" tc -s qdisc show dev "$DEV_L0")"
        sed -n '1,3p' <<<"$qdiscs"
        return 0
    fi
    say "down (or partly up: run 'up' again to repair)"
    return 1
}

cmd_exec() {
    [ "$#" -gt 0 ] || die "usage: netem.sh exec CMD [ARGS...]"
    ns_exists "$NS_REMOTE" || die "not up; run: benches/netem.sh up"
    exec ip netns exec "$NS_REMOTE" "$@"
}

# Round-trip time from TCP connects, then iperf3 with 1 and 8 flows each way.
cmd_check() {
    need_root
    is_up || die "not up; run: benches/netem.sh up"
    command -v iperf3 >/dev/null 2>&1 || die "iperf3 not found (apt-get install iperf3)"
    local port=5299 dir flows out reverse
    ip netns exec "$NS_REMOTE" iperf3 -s -p "$port" >/dev/null 2>&1 &
    CHECK_SERVER=$!
    trap 'kill "$CHECK_SERVER" 2>/dev/null || true' EXIT
    sleep 0.5
    python3 - "$IP_REMOTE" "$port" <<'EOF'
import socket, statistics, sys, time
host, port = sys.argv[1], int(sys.argv[2])
rtts = []
for _ in range(20):
    t = time.perf_counter()
    socket.create_connection((host, port)).close()
    rtts.append((time.perf_counter() - t) * 1000)
    time.sleep(0.02)
print(f"netem: TCP connect RTT: median {statistics.median(rtts):.2f} ms, min {min(rtts):.2f}, max {max(rtts):.2f}")
EOF
    for dir in upload download; do
        reverse=()
        [ "$dir" = download ] && reverse=(-R) # the server sends
        for flows in 1 8; do
            out="$(iperf3 -c "$IP_REMOTE" -p "$port" -t "$CHECK_SECONDS" -O 1 -f m -P "$flows" "${reverse[@]}" |
                grep -E 'receiver' | tail -1)"
            # iperf3 -f m reports Mbit/s; convert to MB/s (10^6 bytes).
            awk -v d="$dir" -v n="$flows" '{ for (i = 1; i <= NF; i++) if ($i == "Mbits/sec") printf "netem: %-8s %d flow(s): %7.1f MB/s\n", d, n, $(i-1) / 8 }' <<<"$out"
            sleep 0.5
        done
    done
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
exec)
    shift
    cmd_exec "$@"
    ;;
ip) echo "$IP_REMOTE" ;;
check) cmd_check ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
