"""Token-shaped text out of everything the detector keeps or shows: ledger, findings, labels, logs.

Producers should never put a credential in a span (the hooks do not), but one that does must not
see it come back on ``/metrics``, ``/api/findings``, in the snapshot file or in a log line. A
``Bearer``/``Basic`` credential and anything shaped like a JWT (``eyJ...x.y.z``) is replaced.
"""

from __future__ import annotations

import re

REDACTED = "[redacted]"
_TOKEN = re.compile(r"\b(?:bearer|basic)\s+[^\s,;\"']+|eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*",
                    re.IGNORECASE | re.ASCII)


def redact(text: str) -> str:
    """``text`` with every token-shaped part replaced by ``[redacted]``."""
    return _TOKEN.sub(REDACTED, text)
