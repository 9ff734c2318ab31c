# SPDX-License-Identifier: Apache-2.0
"""One small transfer script, run by test_same_script.py once through kvbridge.mooncake's
TransferEngine and once through the native API: register a buffer, WRITE a pattern to a peer in
scattered blocks, READ it back into another buffer, check every byte, print a digest.

usage: same_script.py mooncake|native TARGET REMOTE_ADDR"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import addr, digest, pattern  # noqa: E402

BS, NBLOCKS = 64 << 10, 16


def backend(api):
    """(register(addr, n), write(target, locals, remotes, lens), read(...), close())"""
    if api == "mooncake":
        from kvbridge.mooncake import TransferEngine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0

        def check(rc):
            assert rc == 0, rc
        return (lambda a, n: check(te.register_memory(a, n)),
                lambda t, l, r, n: check(te.batch_transfer_sync_write(t, l, r, n)),
                lambda t, l, r, n: check(te.batch_transfer_sync_read(t, l, r, n)), te.close)
    import kvbridge
    e = kvbridge.Engine()
    segs = {}

    def run(op, t, l, r, n):
        seg = segs.get(t) or segs.setdefault(t, e.open_segment(t))
        e.transfer([kvbridge.Request(op, a, seg, b, c) for a, b, c in zip(l, r, n)])
    return (lambda a, n: e.register(a, n),
            lambda *x: run(kvbridge.Op.WRITE, *x), lambda *x: run(kvbridge.Op.READ, *x), e.close)


def main(api, target, remote):
    register, write, read, close = backend(api)
    src = pattern(7, BS * NBLOCKS)
    dst = pattern(8, BS * NBLOCKS)
    register(addr(src), src.nbytes)
    register(addr(dst), dst.nbytes)
    order = [(i * 5) % NBLOCKS for i in range(NBLOCKS)]  # scattered on the peer
    write(target, [addr(src) + i * BS for i in range(NBLOCKS)],
          [remote + b * BS for b in order], [BS] * NBLOCKS)
    read(target, [addr(dst) + i * BS for i in range(NBLOCKS)],
         [remote + b * BS for b in order], [BS] * NBLOCKS)
    assert (src == dst).all(), "bytes differ"
    close()
    print(digest(dst))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
