#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A prefill process and a decode process moving a paged KV cache the way SGLang's Mooncake
backend (disaggregation/mooncake) does, written against Mooncake's TransferEngine API and run on
kvbridge.mooncake - the only line that differs from Mooncake is the import.

    KVBRIDGE_LIBRARY=build/libkvbridge.so python3 python/examples/pd_connector.py

Each side holds, per layer, a K and a V buffer of shape [pages, page_size, kv_heads, head_dim]
(numpy float16; torch tensors with --torch where torch is installed). Both register every buffer
with batch_register_memory. Per request, the decode side allocates pages and sends its session id,
buffer addresses and page indices to the prefill side over a bootstrap channel (SGLang uses ZMQ;
here a multiprocessing queue); the prefill side "computes" the KV cache of the prompt into its own
pages, groups contiguous page runs and writes them with batch_transfer_sync_write, layer by layer,
then reports the request done; the decode side checks every byte of every page it received and
that no other page changed. Exit status 0 means every byte arrived."""

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

try:  # run from a checkout without installing
    import kvbridge  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvbridge.mooncake import TransferEngine  # was: from mooncake.engine import TransferEngine

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM = 8, 256, 16, 4, 64
REQUESTS = 6


def alloc_kv(use_torch):
    """Per layer a K and a V buffer; returns (arrays, data pointers, byte lengths, page bytes)."""
    shape = (PAGES, PAGE_SIZE, HEADS, HEAD_DIM)
    if use_torch:
        import torch
        bufs = [torch.zeros(shape, dtype=torch.float16) for _ in range(2 * LAYERS)]
        ptrs = [b.data_ptr() for b in bufs]
        arrays = [b.numpy() for b in bufs]
    else:
        arrays = [np.zeros(shape, np.float16) for _ in range(2 * LAYERS)]
        ptrs = [a.ctypes.data for a in arrays]
    lens = [a.nbytes for a in arrays]
    return arrays, ptrs, lens, arrays[0][0].nbytes


def kv_values(req, buf, ntok):
    """What the prefill computes for request `req` in buffer `buf` (layer*2 + K/V): a pattern
    that differs per request, buffer, token, head and dimension."""
    rng = np.random.default_rng(req * 1000 + buf)
    return rng.standard_normal((ntok, HEADS, HEAD_DIM)).astype(np.float16)


def group_contiguous(src, dst):
    """SGLang's group_concurrent_contiguous: runs where both page lists step by one."""
    runs, i = [], 0
    while i < len(src):
        j = i
        while j + 1 < len(src) and src[j + 1] == src[j] + 1 and dst[j + 1] == dst[j] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i + 1))
        i = j + 1
    return runs


def engine(protocol):
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        raise SystemExit("initialize failed")
    return te, f"127.0.0.1:{te.get_rpc_port()}"  # SGLang's mooncake session id


def prefill(to_decode, from_decode, protocol, use_torch):
    te, _session = engine(protocol)
    arrays, ptrs, lens, page_bytes = alloc_kv(use_torch)
    assert te.batch_register_memory(ptrs, lens) == 0
    free_pages = list(range(PAGES))[::-1]
    moved = 0
    while True:
        msg = from_decode.get()
        if msg is None:
            break
        req, ntok, session, dst_ptrs, dst_pages = msg
        npages = -(-ntok // PAGE_SIZE)
        src_pages = [free_pages.pop() for _ in range(npages)]
        for b in range(2 * LAYERS):  # the forward pass writes the prompt's KV into our pages
            vals = kv_values(req, b, ntok)
            for t in range(ntok):
                arrays[b][src_pages[t // PAGE_SIZE], t % PAGE_SIZE] = vals[t]
        runs = group_contiguous(src_pages, dst_pages)
        for b in range(2 * LAYERS):  # one batch per layer buffer, as SGLang sends them
            srcs = [ptrs[b] + s * page_bytes for s, _, _ in runs]
            dsts = [dst_ptrs[b] + d * page_bytes for _, d, _ in runs]
            sizes = [n * page_bytes for _, _, n in runs]
            if te.batch_transfer_sync_write(session, srcs, dsts, sizes) != 0:
                to_decode.put((req, "failed"))
                break
            moved += sum(sizes)
        else:
            to_decode.put((req, "done"))
        free_pages.extend(src_pages)
    te.close()
    to_decode.put(("bytes", moved))


def decode(to_prefill, from_prefill, protocol, use_torch):
    te, session = engine(protocol)
    arrays, ptrs, lens, page_bytes = alloc_kv(use_torch)
    assert te.batch_register_memory(ptrs, lens) == 0
    rng = np.random.default_rng(7)
    free_pages = list(rng.permutation(PAGES))
    owned = {}
    for req in range(REQUESTS):
        ntok = int(rng.integers(1, 12 * PAGE_SIZE))
        npages = -(-ntok // PAGE_SIZE)
        # partly contiguous, partly scattered, like a real page allocator's
        pages = sorted(int(p) for p in free_pages[:npages]) if req % 2 else \
            [int(p) for p in free_pages[:npages]]
        free_pages = free_pages[npages:]
        owned[req] = (ntok, pages)
        to_prefill.put((req, ntok, session, ptrs, pages))
    bad = 0
    for _ in range(REQUESTS):
        req, status = from_prefill.get(timeout=60)
        if status != "done":
            print(f"request {req}: {status}")
            bad += 1
            continue
        ntok, pages = owned[req]
        for b in range(2 * LAYERS):
            vals = kv_values(req, b, ntok)
            got = np.stack([arrays[b][pages[t // PAGE_SIZE], t % PAGE_SIZE] for t in range(ntok)])
            if not np.array_equal(got.view(np.uint16), vals.view(np.uint16)):
                print(f"request {req}, buffer {b}: bytes differ")
                bad += 1
    # pages no request owned must still be zero
    used = {p for _, pages in owned.values() for p in pages}
    for b in range(2 * LAYERS):
        for p in range(PAGES):
            if p not in used and arrays[b][p].any():
                print(f"buffer {b}, page {p}: written although no request owns it")
                bad += 1
    to_prefill.put(None)
    _, moved = from_prefill.get(timeout=60)
    te.close()
    print(f"decode: {REQUESTS} requests, {moved / 2**20:.1f} MiB of KV cache, "
          f"{'every byte verified' if not bad else f'{bad} errors'}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--protocol", default="tcp", help='Mooncake protocol ("tcp", "rdma")')
    ap.add_argument("--torch", action="store_true", help="torch tensors instead of numpy arrays")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")  # a fresh interpreter, as two serving processes are
    to_prefill, to_decode = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=prefill, args=(to_decode, to_prefill, args.protocol, args.torch))
    p.start()
    t0 = time.monotonic()
    try:
        bad = decode(to_prefill, to_decode, args.protocol, args.torch)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    print(f"done in {time.monotonic() - t0:.2f} s")
    sys.exit(1 if bad or p.exitcode else 0)


if __name__ == "__main__":
    main()
