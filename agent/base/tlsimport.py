"""Importing aiohttp without the two CA bundles it loads at import time.

aiohttp builds two client SSL contexts when ``aiohttp.connector`` is imported
(``_SSL_CONTEXT_VERIFIED`` and ``_SSL_CONTEXT_UNVERIFIED``, aiohttp 3.14 ``aiohttp/connector.py``),
and each loads the system's CA bundle: about 2 MiB of resident memory and 100-200 ms of CPU at
start-up on a small node. The agent never uses them: every https request it makes passes the
context built from the cluster's CA (``agent/kube/access.py``).

:func:`without_default_ca_bundle` is entered around the ``import aiohttp`` of the API client
(``agent/kube/client.py``), the one module that uses aiohttp. While it is entered,
``ssl.create_default_context()`` without CA arguments and ``SSLContext.set_default_verify_paths()``
load no certificates. A context made meanwhile verifies against nothing, so a request that relied
on it would fail verification: closed, never open.
"""

from __future__ import annotations

import ssl
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.Lock()


@contextmanager
def without_default_ca_bundle() -> Iterator[None]:
    """Enter around ``import aiohttp``; does nothing once ``aiohttp.connector`` is imported."""
    with _lock:
        if "aiohttp.connector" in sys.modules:
            yield
            return
        create, verify_paths = ssl.create_default_context, ssl.SSLContext.set_default_verify_paths

        def bare(
            purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH,
            *,
            cafile: Any = None,
            capath: Any = None,
            cadata: Any = None,
        ) -> ssl.SSLContext:
            if cafile is not None or capath is not None or cadata is not None:
                return create(purpose, cafile=cafile, capath=capath, cadata=cadata)
            server_auth = purpose == ssl.Purpose.SERVER_AUTH
            return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT if server_auth else ssl.PROTOCOL_TLS_SERVER)

        ssl.create_default_context = bare
        ssl.SSLContext.set_default_verify_paths = lambda self: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            ssl.create_default_context = create
            ssl.SSLContext.set_default_verify_paths = verify_paths  # type: ignore[method-assign]
