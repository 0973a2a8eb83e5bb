"""A small client for `kvq serve` on the standard library (the tests and scripts/serve_load.py).

    with Server(kvq, ["--kv", "q8_0"]) as s:
        status, body = s.post({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
        text, events = s.stream({...})
        s.metrics()["kvq_kv_bytes"]
"""
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

from loopback import free_port  # noqa: F401 - re-exported for the tests


class Server:
    """`kvq serve --port 0 ARGS` as a context manager: waits for its "listening" line, stops it with
    SIGTERM on exit and keeps its exit code and stderr."""

    def __init__(self, kvq, args, env=None, startup_s=600):
        self.args = [str(kvq), "serve", "--port", "0", *map(str, args)]
        self.env = env
        self.startup_s = startup_s
        self.proc = None
        self.port = None
        self.rc = None
        self.stderr = ""
        self._err = []

    def __enter__(self):
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=self.env)
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"kvq serve exited ({self.proc.wait()}) before listening: {''.join(self._err)}")
            self._err.append(line)
            m = re.search(r"listening on http://[^:]+:(\d+) ", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            raise RuntimeError("kvq serve did not listen in time")
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        return self

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self._err.append(line)

    def stop(self, timeout=120):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.rc = self.proc.wait(timeout=timeout)
        time.sleep(0.05)
        self.stderr = "".join(self._err)
        return self.rc

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()
        else:
            self.rc = self.proc.returncode
            self.stderr = "".join(self._err)

    def conn(self, timeout=300):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=300):
        """(status, headers, bytes) of one request on a fresh connection."""
        c = self.conn(timeout)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        c.request(method, path, data, headers or {"Content-Type": "application/json"})
        r = c.getresponse()
        out = r.status, dict(r.getheaders()), r.read()
        c.close()
        return out

    def post(self, body, timeout=300, path="/v1/completions"):
        status, _, data = self.request("POST", path, body, timeout=timeout)
        return status, json.loads(data)

    def chat(self, body, timeout=300):
        return self.post(body, timeout, "/v1/chat/completions")

    def stream(self, body, timeout=300, on_event=None, path="/v1/completions"):
        """Streams a completion (or, path /v1/chat/completions, a chat's deltas): (text, events), events the
        decoded JSON of each data line ([DONE] last, as the string). on_event(event) may return False to hang
        up."""
        c = self.conn(timeout)
        c.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"stream: HTTP {r.status}: {r.read()!r}")
        text, events = "", []
        for raw in r:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            ev = payload if payload == "[DONE]" else json.loads(payload)
            events.append(ev)
            if isinstance(ev, dict) and ev.get("choices"):
                ch = ev["choices"][0]
                text += ch["text"] if "text" in ch else ch["delta"].get("content", "")
            if on_event is not None and on_event(ev) is False:
                c.close()
                return text, events
            if ev == "[DONE]":
                break
        c.close()
        return text, events

    def metrics(self):
        _, _, data = self.request("GET", "/metrics")
        m = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                m[k] = float(v)
        return m

    def rss_kb(self, field="VmRSS"):
        """The server's resident memory now (VmRSS) or at its peak (VmHWM), KiB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0


def wait_for(pred, timeout=60, step=0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


def env_with(**kw):
    e = dict(os.environ)
    e.update({k: str(v) for k, v in kw.items()})
    return e
