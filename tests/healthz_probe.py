"""``python -m tests.healthz_probe PORT``: ask /healthz every 20 ms until stdin closes, then print
the slowest answer and the count as JSON. It runs in a process of its own so that what it
measures is the agent's event loop, not the GIL of the test process that drives the attacks."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def main() -> None:
    port = int(sys.argv[1])
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    slowest, answers = 0.0, 0
    while not done.wait(0.02):
        started = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()  # a 503 at the connection cap is an answer too
        except OSError:
            continue
        finally:
            connection.close()
        slowest = max(slowest, time.monotonic() - started)
        answers += 1
        print(json.dumps({"answers": answers, "max": slowest}), flush=True)
    print(json.dumps({"slowest": slowest, "answers": answers}), flush=True)


if __name__ == "__main__":
    main()
