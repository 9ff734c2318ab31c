# SPDX-License-Identifier: Apache-2.0
"""Loads libkvbridge.so and declares the C API's structs and prototypes for ctypes.

Every foreign call goes through a ctypes.CDLL, which releases the GIL for the duration of the
call, so a thread blocked in kvb_batch_wait() or kvb_notify_recv() never stalls other Python
threads. The struct layouts mirror include/kvbridge/{engine,kv}.h field for field; the config
struct is passed with its own sizeof, so a newer library that grew kvb_config_t keeps working.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_int32, c_size_t, c_ubyte,
                    c_uint, c_uint16, c_uint32, c_uint64, c_void_p)
from typing import Optional

NAME_MAX = 255
LOCATION_MAX = 63
NOTIFY_MAX = 4096
STATS_PATHS_MAX = 8
KV_MODEL_MAX = 127
KV_REASON_MAX = 256

kvb_segment_t = c_uint32


class Config(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("bind_addr", c_char_p),
        ("advertise_addr", c_char_p),
        ("port", c_uint16),
        ("port_max", c_uint16),
        ("segment_name", c_char_p),
        ("metadata", c_char_p),
        ("progress_threads", c_int),
        ("lanes", c_int),
        ("timeout_ms", c_uint32),
        ("connect_timeout_ms", c_uint32),
        ("protocol", c_char_p),
        ("copy_threads", c_int),
        ("cluster", c_char_p),
        ("metadata_ttl_ms", c_uint32),
        ("secret", c_void_p),
        ("secret_len", c_size_t),
        ("insecure", c_int),
        ("peer_timeout_ms", c_uint32),
        ("max_connections", c_uint32),
        ("shm_map_max", c_uint64),
    ]


class ConfigFabric(Structure):
    """kvb_config_t of libraries with the libfabric data path (they export
    kvb_engine_fabric_provider): the same fields plus fabric_provider at the end."""
    _fields_ = Config._fields_ + [("fabric_provider", c_char_p)]


class ConfigCongestion(Structure):
    """kvb_config_t of libraries that export kvb_engine_tcp_congestion: tcp_congestion after
    fabric_provider."""
    _fields_ = ConfigFabric._fields_ + [("tcp_congestion", c_char_p)]


class ConfigBusyPoll(Structure):
    """kvb_config_t of libraries that export kvb_engine_busy_poll_us: busy_poll_us after
    tcp_congestion."""
    _fields_ = ConfigCongestion._fields_ + [("busy_poll_us", c_uint32)]


class ConfigCpus(Structure):
    """kvb_config_t of libraries that export kvb_engine_cpus: cpus after busy_poll_us."""
    _fields_ = ConfigBusyPoll._fields_ + [("cpus", c_char_p)]


class ConfigLinger(Structure):
    """kvb_config_t of libraries that export kvb_engine_linger_us: linger_us after cpus."""
    _fields_ = ConfigCpus._fields_ + [("linger_us", c_uint32)]


def config_type() -> type:
    """The kvb_config_t layout the loaded library knows (the struct only grows at its end)."""
    if hasattr(load(), "kvb_engine_linger_us"):
        return ConfigLinger
    if hasattr(load(), "kvb_engine_cpus"):
        return ConfigCpus
    if hasattr(load(), "kvb_engine_busy_poll_us"):
        return ConfigBusyPoll
    if hasattr(load(), "kvb_engine_tcp_congestion"):
        return ConfigCongestion
    return ConfigFabric if has_fabric() else Config


def has_fabric() -> bool:
    """True if the loaded library has the libfabric data path (fabric_provider in its config)."""
    return hasattr(load(), "kvb_engine_fabric_provider")


class PathStats(Structure):
    _fields_ = [("name", c_char * 16), ("ops", c_uint64), ("bytes", c_uint64)]


class Stats(Structure):
    _fields_ = [
        ("requests_completed", c_uint64),
        ("requests_failed", c_uint64),
        ("npaths", c_size_t),
        ("paths", PathStats * STATS_PATHS_MAX),
    ]


class RegionInfo(Structure):
    _fields_ = [("addr", c_uint64), ("len", c_uint64), ("access", c_uint),
                ("location", c_char * (LOCATION_MAX + 1))]


class Request(Structure):
    _fields_ = [("opcode", c_int), ("local", c_void_p), ("segment", kvb_segment_t),
                ("remote", c_uint64), ("len", c_size_t)]


class ReqStatus(Structure):
    _fields_ = [("state", c_int), ("error", c_int), ("bytes", c_uint64)]


class BatchOpts(Structure):
    _fields_ = [("timeout_ms", c_uint32), ("notify_segment", kvb_segment_t),
                ("notify", c_void_p), ("notify_len", c_size_t)]


class Notification(Structure):
    _fields_ = [("from_", c_char * (NAME_MAX + 1)), ("len", c_size_t),
                ("data", c_ubyte * NOTIFY_MAX), ("reply_to", c_uint64)]


class KvSlot(Structure):
    _fields_ = [("layer", c_uint32), ("kind", c_int), ("base", c_uint64), ("len", c_uint64),
                ("block_bytes", c_uint64), ("num_blocks", c_uint64), ("num_heads", c_uint32),
                ("head_bytes", c_uint32), ("order", c_int)]


class KvLayout(Structure):
    _fields_ = [("model", c_char * (KV_MODEL_MAX + 1)), ("dtype", c_int),
                ("tokens_per_block", c_uint32), ("attn", c_int), ("num_kv_heads", c_uint32),
                ("dp_size", c_int32), ("dp_rank", c_int32), ("tp_size", c_int32),
                ("tp_rank", c_int32), ("num_layers", c_uint32), ("slots", POINTER(KvSlot)),
                ("num_slots", c_size_t)]


class KvTopo(Structure):
    _fields_ = [("dp_size", c_int32), ("tp_size", c_int32), ("attn", c_int),
                ("num_kv_heads", c_uint32), ("order", c_int)]


class KvRoute(Structure):
    _fields_ = [("src_rank", c_int32), ("dst_rank", c_int32), ("head_begin", c_uint32),
                ("head_end", c_uint32)]


class KvPlanArgs(Structure):
    _fields_ = [("op", c_int), ("segment", kvb_segment_t), ("src_blocks", POINTER(c_uint64)),
                ("num_src", c_size_t), ("dst_blocks", POINTER(c_uint64)), ("num_dst", c_size_t),
                ("layers", POINTER(c_uint32)), ("num_layers", c_size_t),
                ("route", POINTER(KvRoute))]


P = c_void_p  # opaque handles (engine, batch, agent, link, xfer)

# name: (restype, argtypes)
_PROTOS = {
    "kvb_strerror": (c_char_p, [c_int]),
    "kvb_status_name": (c_char_p, [c_int]),
    "kvb_config_init_v": (None, [c_void_p, c_size_t]),  # Config or ConfigFabric
    "kvb_engine_create": (c_int, [c_void_p, POINTER(P)]),
    "kvb_engine_destroy": (None, [P]),
    "kvb_engine_stats": (c_int, [P, POINTER(Stats)]),
    "kvb_engine_segment_name": (c_char_p, [P]),
    "kvb_engine_port": (c_uint16, [P]),
    "kvb_alloc": (c_int, [P, c_size_t, c_uint, POINTER(c_void_p)]),
    "kvb_free": (c_int, [P, c_void_p]),
    "kvb_register": (c_int, [P, c_void_p, c_size_t, c_char_p, c_uint]),
    "kvb_unregister": (c_int, [P, c_void_p]),
    "kvb_segment_open": (c_int, [P, c_char_p, POINTER(kvb_segment_t)]),
    "kvb_segment_close": (c_int, [P, kvb_segment_t]),
    "kvb_segment_regions": (c_int, [P, kvb_segment_t, c_int, POINTER(RegionInfo), c_size_t,
                                    POINTER(c_size_t)]),
    "kvb_engine_set_attr": (c_int, [P, c_char_p, c_void_p, c_size_t]),
    "kvb_segment_attr": (c_int, [P, kvb_segment_t, c_char_p, c_void_p, c_size_t,
                                 POINTER(c_size_t)]),
    "kvb_segment_refresh": (c_int, [P, kvb_segment_t]),
    "kvb_segment_transport": (c_int, [P, kvb_segment_t, POINTER(c_char_p)]),
    "kvb_segment_incarnation": (c_int, [P, kvb_segment_t, POINTER(c_uint64)]),
    "kvb_batch_submit": (c_int, [P, POINTER(Request), c_size_t, POINTER(BatchOpts), POINTER(P)]),
    "kvb_batch_size": (c_size_t, [P]),
    "kvb_batch_status": (c_int, [P, c_size_t, POINTER(ReqStatus)]),
    "kvb_batch_wait": (c_int, [P, c_int]),
    "kvb_batch_cancel": (c_int, [P]),
    "kvb_batch_settle": (c_int, [P, c_int]),
    "kvb_batch_free": (None, [P]),
    "kvb_notify_send": (c_int, [P, kvb_segment_t, c_void_p, c_size_t, c_int]),
    "kvb_notify_recv": (c_int, [P, POINTER(Notification), c_int]),
    "kvb_notify_reply": (c_int, [P, POINTER(Notification), c_void_p, c_size_t]),
    "kvb_log_set_level": (None, [c_int]),
    # kv.h
    "kvb_kv_slot_name": (c_char_p, [c_int]),
    "kvb_kv_layout_validate": (c_int, [POINTER(KvLayout), c_char_p, c_size_t]),
    "kvb_kv_layout_check_pair": (c_int, [POINTER(KvLayout), POINTER(KvLayout), c_char_p,
                                         c_size_t]),
    "kvb_kv_layout_topo": (c_int, [POINTER(KvLayout), POINTER(KvTopo)]),
    "kvb_kv_layout_encode": (c_int, [POINTER(KvLayout), c_char_p, c_size_t, POINTER(c_size_t)]),
    "kvb_kv_layout_decode": (c_int, [c_char_p, c_size_t, POINTER(POINTER(KvLayout)), c_char_p,
                                     c_size_t]),
    "kvb_kv_layout_free": (None, [POINTER(KvLayout)]),
    "kvb_kv_verdict_name": (c_char_p, [c_int]),
    "kvb_kv_guard_topo": (c_int, [POINTER(KvTopo), POINTER(KvTopo), c_char_p, c_size_t]),
    "kvb_kv_guard": (c_int, [POINTER(KvLayout), POINTER(KvLayout), c_char_p, c_size_t]),
    "kvb_kv_route": (c_int, [POINTER(KvTopo), POINTER(KvTopo), c_int32, POINTER(KvRoute),
                             c_size_t, POINTER(c_size_t)]),
    "kvb_kv_plan": (c_int, [POINTER(KvLayout), POINTER(KvLayout), POINTER(KvPlanArgs),
                            POINTER(POINTER(Request)), POINTER(c_size_t), c_char_p, c_size_t]),
    "kvb_kv_plan_free": (None, [POINTER(Request)]),
    "kvb_kv_agent_create": (c_int, [P, POINTER(KvLayout), c_int, POINTER(P), c_char_p,
                                    c_size_t]),
    "kvb_kv_agent_destroy": (None, [P]),
    "kvb_kv_link_open": (c_int, [P, c_char_p, POINTER(P), c_char_p, c_size_t]),
    "kvb_kv_link_close": (None, [P]),
    "kvb_kv_link_verdict": (c_int, [P]),
    "kvb_kv_link_layout": (POINTER(KvLayout), [P]),
    "kvb_kv_link_has_route": (c_int, [P]),
    "kvb_kv_xfer_begin": (c_int, [P, c_char_p, c_int, POINTER(c_uint64), POINTER(c_uint64),
                                  c_size_t, c_int, POINTER(P), c_char_p, c_size_t]),
    "kvb_kv_xfer_layer": (c_int, [P, c_uint32]),
    "kvb_kv_xfer_all": (c_int, [P]),
    "kvb_kv_xfer_finish": (c_int, [P]),
    "kvb_kv_xfer_settle": (c_int, [P, c_int]),
    "kvb_kv_xfer_free": (None, [P]),
    "kvb_kv_give_up": (c_int, [P, c_char_p, c_int]),
    "kvb_kv_expect": (c_int, [P, c_char_p, POINTER(P), c_size_t, c_int]),
    "kvb_kv_wait": (c_int, [P, c_char_p, c_int]),
    "kvb_kv_agent_notify_recv": (c_int, [P, POINTER(Notification), c_int]),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


def _candidates() -> list:
    """Where to look for the library, in order: KVBRIDGE_LIBRARY, next to this package, the
    dynamic loader's cache (ldconfig), then the prefixes `cmake --install` uses by default."""
    env = os.environ.get("KVBRIDGE_LIBRARY")
    if env:
        return [env]  # an explicit choice is never second-guessed
    here = os.path.dirname(os.path.abspath(__file__))
    out = [os.path.join(here, "libkvbridge.so")]
    found = ctypes.util.find_library("kvbridge")
    if found:
        out.append(found)
    for d in ("/usr/local/lib", "/usr/local/lib64", "/usr/local/lib/x86_64-linux-gnu",
              "/usr/local/lib/aarch64-linux-gnu", "/usr/lib", "/usr/lib64",
              "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
        out.append(os.path.join(d, "libkvbridge.so.0"))
        out.append(os.path.join(d, "libkvbridge.so"))
    return out


def load() -> ctypes.CDLL:
    """Returns the loaded library, loading it on first use (raises OSError if none is found)."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for cand in _candidates():
            if os.sep in cand and not os.path.exists(cand):
                tried.append(cand + " (absent)")
                continue
            try:
                lib = ctypes.CDLL(cand)
            except OSError as e:
                tried.append(f"{cand} ({e})")
                continue
            for name, (res, args) in _PROTOS.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
            for name in ("kvb_engine_fabric_provider", "kvb_engine_tcp_congestion",
                         "kvb_engine_cpus"):
                if hasattr(lib, name):  # optional: newer libraries only
                    getattr(lib, name).restype = c_char_p
                    getattr(lib, name).argtypes = [P]
            for name in ("kvb_engine_busy_poll_us", "kvb_engine_linger_us"):
                if hasattr(lib, name):
                    getattr(lib, name).restype = c_uint32
                    getattr(lib, name).argtypes = [P]
            _path = getattr(lib, "_name", cand)
            _lib = lib
            return lib
        raise OSError("libkvbridge.so not found; set KVBRIDGE_LIBRARY to its path or install it "
                      "with `cmake --install build`. Tried: " + "; ".join(tried))


def library_path() -> str:
    """The file the library was loaded from (loads it if needed)."""
    load()
    assert _path is not None
    return _path
