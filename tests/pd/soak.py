#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PD soak (`make soak`, not part of `make test`): mixed load on a PD deployment while a prefill
and a decode instance are SIGKILLed and restarted at random moments.

Deployment (all on loopback, ports picked by the programs): a metadata server; prefill P1 (TP 2,
pull) and P2 (TP 1, push); decodes D1 and D2 (TP 1); a proxy that discovers them; a colocated
instance as the reference. Clients send prompts of 1..400 bytes, 1..12 tokens, streamed or not;
every fourth answer is compared with the reference's. A killer thread SIGKILLs a prefill or a
decode (in turn) every 15..40 s and restarts it 0.5..3 s later (a new process on a new port,
found by discovery).

Passes when: every failed request was in flight on a killed instance (it started before the kill
plus a short grace and ended after it) and its error names that instance (its URL or one of its
engine segments); no answer differs from the reference; and once the load stops every instance
alive is idle: all blocks free, no lease, reservation or waiter. Prints the numbers.
"""
import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

GRACE_S = 3.0  # a request routed to a killed instance before the proxy saw it go


def now():
    return time.monotonic()


class Inst:
    """One `kvbridge` process with a ready line "... on http://ADDR:PORT"."""

    def __init__(self, binary, args, name, logdir):
        self.name = name
        self.args = args
        self.log = os.path.join(logdir, f"{name}-{int(time.time() * 1000)}.log")
        self.proc = subprocess.Popen([binary] + args, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = None
        deadline = now() + 15
        while now() < deadline and self.url is None:
            with open(self.log) as f:
                for line in f:
                    if "on http://" in line:
                        self.url = "http://" + line.split("on http://")[1].split()[0]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.url is None:
            raise RuntimeError(f"{name} did not start: {open(self.log).read()[-2000:]}")
        self.segments = []

    def fetch_segments(self):
        info = get_json(self.url + "/pd/info")
        self.segments = info.get("segments", []) if info else []

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def get_json(url, timeout=3.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except Exception:
        return None


def complete(base, body, timeout):
    """POSTs a completion; returns dict(ok, status, error, tokens, text)."""
    u = urllib.parse.urlparse(base)
    out = {"ok": False, "status": 0, "error": "", "tokens": None, "text": ""}
    try:
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.getheader("Content-Type", "").startswith("text/event-stream"):
            done = False
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out["error"] = ev["error"].get("message", "error event")
                    break
                out["text"] += ev["choices"][0].get("text") or ""
                if "kvbridge" in ev:
                    out["tokens"] = ev["kvbridge"].get("tokens")
            out["ok"] = done and not out["error"]
            if not done and not out["error"]:
                out["error"] = "stream ended without [DONE]"
        else:
            j = json.loads(r.read() or b"{}")
            if r.status == 200 and "choices" in j:
                out["ok"] = True
                out["text"] = j["choices"][0].get("text", "")
                out["tokens"] = j.get("kvbridge", {}).get("tokens")
            else:
                out["error"] = j.get("error", {}).get("message", f"HTTP {r.status}")
        c.close()
    except Exception as e:  # connection reset, timeout: the error names no instance
        out["error"] = f"{type(e).__name__}: {e}"
    return out


class Soak:
    def __init__(self, a):
        self.a = a
        self.logdir = tempfile.mkdtemp(prefix="kvb_soak_")
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.results = []  # (start, end, ok, error, stream)
        self.kills = []    # (time, name, url, segments)
        self.compared = self.differ = 0
        self.differ_first = ""

    def serve(self, name, role, tp, mode):
        args = ["serve", "--role", role, "--model", "tiny-gqa", "--tp", str(tp), "--port", "0",
                "--kv-mode", mode, "--blocks", "128", "--lease-ms", "5000"]
        if role != "both":
            args += ["--metadata", self.meta.url, "--metadata-ttl-ms", "1000"]
        inst = Inst(self.a.bin, args, name, self.logdir)
        inst.fetch_segments()
        return inst

    def up(self):
        self.meta = Inst(self.a.bin, ["metadata-server", "--port", "0"], "meta", self.logdir)
        self.inst = {
            "P1": self.serve("P1", "prefill", 2, "pull"),
            "P2": self.serve("P2", "prefill", 1, "push"),
            "D1": self.serve("D1", "decode", 1, "pull"),
            "D2": self.serve("D2", "decode", 1, "pull"),
        }
        self.ref = self.serve("ref", "both", 1, "pull")
        self.proxy = Inst(self.a.bin, ["proxy", "--discover", self.meta.url,
                                       "--discover-interval-ms", "200", "--port", "0",
                                       "--timeout-ms", "20000"], "proxy", self.logdir)
        deadline = now() + 10
        while now() < deadline:
            h = get_json(self.proxy.url + "/health") or {}
            roles = [i.get("role") for i in h.get("instances", []) if i.get("reachable")]
            if roles.count("prefill") >= 2 and roles.count("decode") >= 2:
                break
            time.sleep(0.1)

    def client(self, seed):
        rng = random.Random(seed)
        n = 0
        while not self.stop.is_set():
            plen, mt, stream = rng.randint(0, 400), rng.randint(1, 12), rng.random() < 0.5
            prompt = "".join(chr(32 + rng.randrange(95)) for _ in range(plen))
            body = {"prompt": prompt, "max_tokens": mt, "stream": stream}
            t0 = now()
            r = complete(self.proxy.url, body, 25)
            t1 = now()
            with self.lock:
                self.results.append((t0, t1, r["ok"], r["error"], stream))
            n += 1
            if r["ok"] and n % 4 == 0:
                ref = complete(self.ref.url, dict(body, stream=False), 25)
                if ref["ok"]:
                    with self.lock:
                        self.compared += 1
                        if ref["tokens"] != r["tokens"] or ref["text"] != r["text"]:
                            self.differ += 1
                            self.differ_first = self.differ_first or f"{body}: {r} vs {ref}"

    def killer(self):
        rng = random.Random(self.a.seed)
        roles = ["P", "D"]
        k = 0
        while not self.stop.wait(rng.uniform(15, 40)):
            role = roles[k % 2]
            k += 1
            name = rng.choice([n for n in self.inst if n.startswith(role)])
            v = self.inst[name]
            with self.lock:
                self.kills.append((now(), name, v.url, list(v.segments)))
            v.kill()
            print(f"[{now() - self.t0:6.1f}s] SIGKILL {name} ({v.url})", flush=True)
            if self.stop.wait(rng.uniform(0.5, 3.0)):
                break
            spec = {"P1": ("prefill", 2, "pull"), "P2": ("prefill", 1, "push"),
                    "D1": ("decode", 1, "pull"), "D2": ("decode", 1, "pull")}[name]
            self.inst[name] = self.serve(name, *spec)
            print(f"[{now() - self.t0:6.1f}s] restarted {name} on {self.inst[name].url}",
                  flush=True)

    def explained(self, t0, t1, err):
        for (tk, name, url, segs) in self.kills:
            if t0 <= tk + GRACE_S and t1 >= tk and (url in err or any(s in err for s in segs)):
                return name
        return None

    def idle(self, inst):
        h = get_json(inst.url + "/health")
        if not h:
            return False, "no /health"
        ok = (h["free_blocks"] == h["total_blocks"] and h.get("leases") == 0
              and h.get("reservations") == 0 and h.get("draining") == 0
              and h.get("active") == 0 and h["queue"]["depth"] == 0)
        return ok, json.dumps({k: h.get(k) for k in ("free_blocks", "total_blocks", "leases",
                                                     "reservations", "draining", "active")})

    def run(self):
        self.up()
        self.t0 = now()
        threads = [threading.Thread(target=self.client, args=(i,)) for i in range(self.a.clients)]
        killer = threading.Thread(target=self.killer)
        for t in threads + [killer]:
            t.start()
        end = self.t0 + self.a.seconds
        while now() < end:
            time.sleep(min(10, end - now()))
            with self.lock:
                n, ok = len(self.results), sum(1 for r in self.results if r[2])
            print(f"[{now() - self.t0:6.1f}s] {n} requests, {ok} ok", flush=True)
        self.stop.set()
        for t in threads + [killer]:
            t.join()
        return self.report()

    def report(self):
        fails = [r for r in self.results if not r[2]]
        unexplained, by_victim = [], {}
        for (t0, t1, ok, err, stream) in fails:
            v = self.explained(t0, t1, err)
            if v:
                by_victim[v] = by_victim.get(v, 0) + 1
            else:
                unexplained.append(f"[{t0 - self.t0:.1f}-{t1 - self.t0:.1f}s] {err}")
        # Leases of requests whose decode died end after --lease-ms; reservations whose prefill
        # died after the request's deadline (20 s).
        leaks = {}
        deadline = now() + 30
        alive = list(self.inst.values()) + [self.ref]
        while now() < deadline:
            leaks = {i.name: d for i in alive for ok, d in [self.idle(i)] if not ok}
            if not leaks:
                break
            time.sleep(0.5)
        ok_n = len(self.results) - len(fails)
        secs = self.a.seconds
        print(f"\nsoak: {secs:.0f} s, {len(self.results)} requests ({ok_n} ok, "
              f"{len(self.results) / secs:.1f}/s), {len(self.kills)} kills "
              f"({', '.join(k[1] for k in self.kills)})")
        print(f"failed: {len(fails)}, each in flight on a killed instance: "
              f"{len(fails) - len(unexplained)} {by_victim}; unexplained: {len(unexplained)}")
        print(f"compared with the colocated reference: {self.compared}, differ: {self.differ}")
        print(f"instances not idle after the load: {len(leaks)} {leaks}")
        for u in unexplained[:20]:
            print("  unexplained:", u)
        if self.differ:
            print("  first difference:", self.differ_first[:500])
        print(f"logs: {self.logdir}")
        return 0 if not unexplained and not self.differ and not leaks else 1

    def down(self):
        for i in list(getattr(self, "inst", {}).values()) + [getattr(self, n, None)
                                                           for n in ("ref", "proxy", "meta")]:
            if i:
                i.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="build/kvbridge")
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=16)
    s = Soak(p.parse_args())
    try:
        rc = s.run()
    finally:
        s.down()
    sys.exit(rc)


if __name__ == "__main__":
    main()
