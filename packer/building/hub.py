"""Whether the Hugging Face Hub can be reached now, asked once and quickly.

Unreachable, `huggingface_hub` retries a file missing from its cache five times with backoff (about
24 s of "Retrying in 8s" warnings) before it gives up, and `datasets` waits as long; one TCP connect to
the endpoint answers the question in well under a second (a name that does not resolve) or ``timeout``.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def reachable(timeout: float = 3.0) -> bool:
    """True when the Hub's endpoint (``HF_ENDPOINT``) accepts a connection; False offline."""
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False
