"""What the hooks do when their own reading of an exchange fails: it is a defect of theirs, never the application's.

The hooks read copies of what the SDK sends and receives. Whatever input makes that reading raise (a hostile
peer's bytes the readers did not foresee), the exception must not reach the SDK: the application's exchange goes on
as without the hooks, and the hooks leave it unobserved. The first such failure is logged as a warning with its
traceback, later ones at debug, so that a peer sending the same bytes again cannot flood the log.
"""

from __future__ import annotations

import logging

_log = logging.getLogger("mcp_stream_exporter.hooks")
_reported = False


def report(where: str) -> None:
    """Log the exception being handled, from ``where``, as the hooks' defect (call from an ``except`` block)."""
    global _reported
    if _reported:
        _log.debug("hooks could not read %s; left unobserved", where, exc_info=True)
        return
    _reported = True
    _log.warning("hooks could not read %s; it is left unobserved (a defect of the hooks, not of the application: "
                 "later ones are logged at debug)", where, exc_info=True)
