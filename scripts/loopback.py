"""Services on 127.0.0.1 for the tests and the measuring scripts: a free port, a redis-server of their own."""
import shutil
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis():
    """(process, url) of a redis-server on a free loopback port (no persistence), or (None, None) when
    redis-server is not installed or does not answer within 5 s."""
    if shutil.which("redis-server") is None:
        return None, None
    port = free_port()
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                          "no", "--logfile", "/dev/null"])
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return p, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.025)
    p.kill()
    p.wait()
    return None, None
