# SPDX-License-Identifier: Apache-2.0
"""kvbridge: a KV-cache transfer engine for prefill/decode disaggregated LLM serving.

Python binding over libkvbridge.so (ctypes; no compiler needed). The native API is Engine,
Segment, Batch and the KV layer in kvbridge.kv; kvbridge.mooncake is a drop-in for Mooncake's
`mooncake.engine.TransferEngine`. The library is found through KVBRIDGE_LIBRARY, next to this
package, or where `cmake --install` put it. Errors are kvbridge.Error subclasses (kvbridge.errors).
"""

from .engine import (ACCESS_READ, ACCESS_RW, ACCESS_WRITE, NOTIFY_MAX, Batch, Engine,
                     Notification, Op, RegionInfo, ReqState, Request, RequestStatus, Segment,
                     Stats, buffer_info, set_log_level, view)
from .errors import Error, LocalError, PeerError, RemoteError, status_name, strerror
from ._lib import has_fabric, library_path

__version__ = "0.1.0"

__all__ = [
    "ACCESS_READ", "ACCESS_RW", "ACCESS_WRITE", "NOTIFY_MAX", "Batch", "Engine", "Error",
    "LocalError", "Notification", "Op", "PeerError", "RegionInfo", "RemoteError", "ReqState",
    "Request", "RequestStatus", "Segment", "Stats", "buffer_info", "has_fabric", "library_path",
    "set_log_level", "status_name", "strerror", "view",
]
