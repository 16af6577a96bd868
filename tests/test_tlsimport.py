"""agent/base/tlsimport.py: aiohttp imported by the agent holds no CA bundle of its own."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import ssl
import agent.kube.client, agent.observe.debug.server
import aiohttp.connector as c
assert c._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"] == 0, c._SSL_CONTEXT_VERIFIED.cert_store_stats()
assert c._SSL_CONTEXT_VERIFIED.verify_mode == ssl.CERT_REQUIRED  # verifies against nothing: fails closed
assert ssl.create_default_context.__module__ == "ssl"  # put back for everyone else
print("ok")
"""


def test_aiohttp_is_imported_without_its_ca_bundles_and_ssl_is_put_back() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
