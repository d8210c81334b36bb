"""etcd: a lease per acquirer, its queue key ordered by create revision (docs/design.md A13).

Spoken over etcd's gRPC gateway (JSON over HTTP/1.1) with the standard library, so the
backend needs nothing installed. The package, a module per concern:

- `uri`: etcd:// and etcds:// URIs (several members, a login, TLS);
- `gateway`: the calls, each within a deadline and a size, and the watches;
- `queue`: the keys of a lock, the look at its queue and what its answer says;
- `store`: the calls, one request each; `backend`: queue and wait; `lease`: a run's lease, and one
  held by no process; `bell`: a holder's take-over bell; `status`: report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.backends import timeout_for
from lockrun.backends.etcd.backend import EtcdBackend
from lockrun.backends.etcd.lease import EtcdLease
from lockrun.backends.etcd.queue import lock_prefix
from lockrun.backends.etcd.uri import Settings, parse
from lockrun.timing import DEFAULT_TTL

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.uri import LockURI

__all__ = ["EtcdBackend", "EtcdLease", "Settings", "connect", "lock_prefix", "parse"]


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,  # noqa: ARG001 - etcd has nothing to warn of yet
    note: Callable[[str], None] | None = None,
) -> EtcdBackend:
    """Check *uri*; the first call connects, with timeouts that fit leases of *ttl*.

    Durable ones, as MySQL's and PostgreSQL's: each grant and put is a raft write the
    member commits to disk. At a twentieth of the default ttl (1.5 s), one of 100 waiters
    started at once on a loaded host exited 69 waiting for its grant (`python -m bench`).
    """
    ttl = ttl or DEFAULT_TTL
    timeout = timeout_for(ttl, durable=True)
    return EtcdBackend(parse(uri), ttl, timeout, note or (lambda _line: None))
