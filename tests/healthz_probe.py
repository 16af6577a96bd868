"""``python -m tests.healthz_probe PORT PID``: ask /healthz every 20 ms until stdin closes, then
print what it saw as JSON.

It runs in a process of its own, so that what it measures is the agent's event loop and not
the GIL of the test process that drives the attacks. A slow answer alone does not prove a
stalled loop: on a loaded machine the agent may simply not get a CPU. So for each answer it
also reads how much CPU time the agent (process ``PID``) used meanwhile; a stall is an answer
that was slow *and* kept the agent busy: ``stall = min(wait, agent CPU time during the wait)``.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def main() -> None:
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    slowest = stall = 0.0
    answers = 0
    while not done.wait(0.02):
        started, cpu = time.monotonic(), cpu_seconds(pid)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()  # a 503 at the connection cap is an answer too
        except OSError:
            continue
        finally:
            connection.close()
        wait = time.monotonic() - started
        slowest = max(slowest, wait)
        stall = max(stall, min(wait, cpu_seconds(pid) - cpu))
        answers += 1
        print(json.dumps({"answers": answers, "slowest": slowest, "stall": stall}), flush=True)


if __name__ == "__main__":
    main()
