"""PostgreSQL-only faults: a grant whose answer reaches lockrun in two pieces.

What every server backend shares is in tests/contract.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pytest

from tests.support.cli import Held, queue_length, start, wait_for
from tests.support.proxy import Proxy

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.support.servers import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_a_head_takes_a_grant_whose_answer_arrives_in_two_pieces(
    pg_server: PostgresServer, name: str, held: Callable[..., Held]
) -> None:
    """The head of a semaphore queue takes a slot whose answer's end comes late (was 69)."""
    holders = [held("--uri", pg_server.uri, "-n", name, "-s", "2") for _ in range(2)]
    with contextlib.closing(Proxy(("127.0.0.1", pg_server.port), late_tail=0.2)) as proxy:
        through = f"postgresql://lockrun@127.0.0.1:{proxy.port}/lockrun"
        waiter = start("--uri", through, "-n", name, "-s", "2", "-w", "forever", "--", "true")
        wait_for(lambda: queue_length(pg_server.uri, name) == 1, what="the head to wait")
        holders[0].finish()
        _, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
