#!/usr/bin/env python3
"""A userspace delay line for benches/netem.sh: holds every packet of an NFQUEUE for a fixed
time, then lets it through, in order.

Why: the kernel here has no sch_netem (nor sch_fq), so `tc ... netem delay` is impossible. An
iptables rule `-j NFQUEUE --queue-num Q` parks each packet in the kernel; this program gets only
its metadata (copy mode META: no payload is copied), and after DELAY accepts every packet that
is due with a single batch verdict ("accept all ids <= N"). Packets stay in the kernel and in
FIFO order; GSO packets are queued whole (NFQA_CFG_F_GSO), so the cost is one small netlink
message per (GSO) packet. Only the Python standard library is used (raw AF_NETLINK socket).

Usage: netem_delay.py --queue 0 --delay-ms 5 [--maxlen 65536]
Runs until killed. If it dies, the link drops packets (the rule has no --queue-bypass), so a
benchmark never silently runs without the delay.
"""

import argparse
import collections
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 0x2

NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3

NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5

NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 0x4
NF_ACCEPT = 1

PACKET_TYPE = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NFGEN_HDR = struct.Struct("!BBH")  # family, version, res_id (queue number, big endian)
NLA_HDR = struct.Struct("=HH")  # len, type (host order)
PACKET_ID = struct.Struct("!I")


def attr(kind, payload):
    data = NLA_HDR.pack(NLA_HDR.size + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def message(msg, queue, attrs, flags=NLM_F_REQUEST, seq=0):
    body = NFGEN_HDR.pack(socket.AF_UNSPEC, 0, queue) + b"".join(attrs)
    kind = (NFNL_SUBSYS_QUEUE << 8) | msg
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), kind, flags, seq, 0) + body


class DelayLine:
    def __init__(self, queue, delay, maxlen):
        self.queue = queue
        self.delay = delay
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        # A lost notification must not kill the loop: the batch verdict covers its packet.
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.seq = 0
        self.request(NFQNL_MSG_CONFIG, [attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, 0))], check=False)
        self.request(NFQNL_MSG_CONFIG, [attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0))])
        self.request(
            NFQNL_MSG_CONFIG,
            [
                attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
                attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)),
                attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO)),
                attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
            ],
        )

    def request(self, msg, attrs, check=True):
        """Sends a config request and waits for its ack."""
        self.seq += 1
        self.sock.send(message(msg, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, self.seq))
        while True:
            data = self.sock.recv(65536)
            for kind, payload in self.messages(data):
                if kind == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", payload)
                    if err and check:
                        raise OSError(-err, f"nfqueue config: {os.strerror(-err)}")
                    return

    @staticmethod
    def messages(data):
        off = 0
        while off + NLMSG_HDR.size <= len(data):
            length, kind, _, _, _ = NLMSG_HDR.unpack_from(data, off)
            if length < NLMSG_HDR.size:
                break
            yield kind, data[off + NLMSG_HDR.size : off + length]
            off += (length + 3) & ~3

    def packet_id(self, payload):
        off = NFGEN_HDR.size
        while off + NLA_HDR.size <= len(payload):
            length, kind = NLA_HDR.unpack_from(payload, off)
            if length < NLA_HDR.size:
                return None
            if kind & 0x7FFF == NFQA_PACKET_HDR:
                return struct.unpack_from("!I", payload, off + NLA_HDR.size)[0]
            off += (length + 3) & ~3
        return None

    def accept_through(self, packet_id):
        hdr = attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
        self.sock.send(message(NFQNL_MSG_VERDICT_BATCH, self.queue, [hdr]))

    def run(self, tick):
        """Every `tick` seconds: take all new notifications, release all due packets.

        Waking on a timer rather than per packet keeps the cost per packet at one recv and
        one unpack. A packet is stamped when it is read, up to one tick after it arrived, so
        it is stamped half a tick early on average; it is released up to one tick late.
        """
        pending = collections.deque()  # (due time, packet id), in arrival (= id) order
        recv = self.sock.recv
        hdr = NLMSG_HDR.size + NFGEN_HDR.size
        delay = self.delay - tick / 2
        while True:
            now = time.monotonic()
            due = now + delay
            while True:
                try:
                    data = recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                # Fast path: one packet message whose first attribute is NFQA_PACKET_HDR.
                kind = NLMSG_HDR.unpack_from(data)[1]
                if kind == PACKET_TYPE and NLA_HDR.unpack_from(data, hdr)[1] == NFQA_PACKET_HDR:
                    pending.append((due, PACKET_ID.unpack_from(data, hdr + NLA_HDR.size)[0]))
                    continue
                for kind, payload in self.messages(data):
                    if kind == PACKET_TYPE:
                        pid = self.packet_id(payload)
                        if pid is not None:
                            pending.append((due, pid))
            last = None
            while pending and pending[0][0] <= now:
                last = pending.popleft()[1]
            if last is not None:
                self.accept_through(last)
            if pending:
                time.sleep(tick)
            else:
                select.select([self.sock], [], [])  # idle: sleep until a packet arrives


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE number")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay per packet, ms")
    parser.add_argument("--maxlen", type=int, default=65536, help="kernel queue length, packets")
    parser.add_argument("--tick-ms", type=float, default=0.25, help="timer resolution, ms")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    line = DelayLine(args.queue, args.delay_ms / 1000.0, args.maxlen)
    print(f"netem_delay: queue {args.queue}, delay {args.delay_ms} ms, ready", flush=True)
    try:
        line.run(args.tick_ms / 1000.0)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
