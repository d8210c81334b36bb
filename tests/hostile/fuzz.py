"""A fuzz target for what lockrun parses: URIs, durations, records, tokens, metrics, etcd's HTTP.

etcd's: what a gateway sends, as HTTP (`wire`) and as the JSON the etcd backend decodes.

One input of bytes is read as text and thrown at every parser and decoder in turn; each
may refuse it only with its documented error, and redaction must hide what it calls secret.

    python -m tests.hostile.fuzz                 # Hypothesis, LOCKRUN_FUZZ_EXAMPLES inputs
    python -m tests.hostile.fuzz -atheris ARGS   # coverage-guided, if atheris is installed

CI runs it briefly through test_fuzz_target (tests/hostile/test_invariants.py).
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import socket
import sys
import tempfile
from types import SimpleNamespace
from typing import Final

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis._parsers import Encoder
from redis.exceptions import RedisError

from lockrun import ConfigError, UsageError, metrics
from lockrun.backends import (
    Holder,
    next_fence,
    open_backend,
    parse_uri,
    read_identity,
    read_json,
)
from lockrun.backends.etcd import queue as etcd_queue
from lockrun.backends.etcd import wire
from lockrun.backends.file.records import read_record
from lockrun.backends.postgres import keys as postgres_keys
from lockrun.backends.redis import cluster, replies, resp, topology
from lockrun.bounds import MAX_FENCE
from lockrun.delivery import check_variable
from lockrun.detached import parse_token as parse_lease_token
from lockrun.door import parse_token, read_reply, read_request
from lockrun.section import parse_owner
from lockrun.timing import parse_duration
from lockrun.uri import HIDDEN, redact, redacted_by_lockrun, scrub, secret_spans, secrets_of
from lockrun.urifile import read_uri_file

EXAMPLES = int(os.environ.get("LOCKRUN_FUZZ_EXAMPLES", "300"))


def one_input(data: bytes) -> None:
    """Throw *data* at every parser; raise AssertionError where one misbehaves."""
    text = data.decode("utf-8", errors="surrogateescape")
    _uri(text)
    schemes = ("redis://", "mysql://", "postgresql://", "redis://:", "unix:///s?password=")
    nested = ("postgres://h/db?dbname=", "mariadb://u:", "host=h password=", "x=1 passwd = '")
    for scheme in (*schemes, *nested, "redis+cluster://", "rediss+cluster://h,"):
        _uri(scheme + text)
    with contextlib.suppress(UsageError):
        seconds = parse_duration(text, allow_forever=True)
        assert seconds is None or 0 <= seconds < math.inf
    _record(text, data)
    _uri_file(data)
    _keeper(text, data)
    _metrics(data)
    _reply(data)
    _etcd_http(data)
    _etcd_json(text, data)


# What redis-py's parser may raise on a reply no Redis sends: what the backend reports as
# "not Redis's" (`redis._REPLY_ERRORS`).
_REPLY_ERRORS = (RedisError, ValueError, TypeError, AttributeError, IndexError, KeyError)


def _reply(data: bytes) -> None:
    """Read *data*, then the end of the stream, as Redis replies through `resp.Parser`.

    Each is a value or a refusal, within the caps; nothing is read past them.
    """
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(data[:65536])  # what the socket pair holds without a reader
        theirs.shutdown(socket.SHUT_WR)
        connection = SimpleNamespace(
            _sock=ours,
            socket_timeout=1.0,
            encoder=Encoder("utf-8", "strict", decode_responses=True),  # type: ignore[no-untyped-call]
        )
        parser = resp.Parser(65536)
        parser.on_connect(connection)
        with contextlib.suppress(*_REPLY_ERRORS):
            while True:
                parser.read_response()
                assert parser._depth == 0


def _etcd_http(data: bytes) -> None:
    """Read *data*, then the end of the stream, as a gateway's answer and as a watch's stream.

    Only an OSError (`BadHTTP`, a closed stream) may come of it, and nothing longer than asked.
    """
    for prefix in (b"", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"):
        ours, theirs = socket.socketpair()
        with theirs:
            theirs.sendall((prefix + data)[:65536])
            theirs.shutdown(socket.SHUT_WR)
            link = wire.Link("h", 1, 1.0, None)
            link.sock = wire._Socket(fileno=ours.detach())
            link.within(1.0)
            with contextlib.suppress(OSError):
                link._head()
                assert len(link.body(100)) <= 101
            with contextlib.suppress(OSError):
                while line := link.line(100):
                    assert len(line) <= 101
            link.close()


def _etcd_json(text: str, data: bytes) -> None:
    """Decode *text* (and JSON made of it and *data*) as etcd's answers: a Queue or ValueError."""
    raw = base64.b64encode(data).decode()
    kv = {"key": raw, "value": raw, "create_revision": text, "lease": text, "mod_revision": text}
    shapes = (read_json(text), {"responses": [{"response_range": {"kvs": [kv]}}] * 6})
    for answer in (*shapes, {"responses": text, "header": {"revision": text}}):
        with contextlib.suppress(ValueError):  # the one refusal: "came back malformed", 69
            etcd_queue.read_look(answer if isinstance(answer, dict) else {})
    kvs = [kv, {**kv, "key": base64.b64encode(b"lockrun/default/x/q/" + data).decode()}]
    for entries in etcd_queue.group(kvs, b"lockrun/default/", "default").values():
        assert 0 <= etcd_queue.holding(entries) <= max(len(entries), entries[0].identity.slots)
    etcd_queue.lease_named(data)
    assert etcd_queue.is_detached(read_json(text)) in {True, False}


def _keeper(text: str, data: bytes) -> None:
    """Parse *text* as tokens, an --owner and a --var, and *data* as what a door reads."""
    with contextlib.suppress(UsageError):
        token = parse_token(text)
        assert str(token) == text
        assert all(c.isalnum() or c in "._-" for c in text)  # shell-safe: nothing to quote
    for candidate in (text, f"lrl1.{text}"):  # acquire --no-keeper's: one spelling a lease
        with contextlib.suppress(UsageError):
            lease = parse_lease_token(candidate)
            assert str(lease) == candidate
            assert candidate.isascii()
            assert all(c.isalnum() or c in "._-" for c in candidate)
    with contextlib.suppress(UsageError):
        owner = parse_owner(text)
        assert owner is None or owner >= 1
    with contextlib.suppress(UsageError):
        assert check_variable(text).isidentifier()
    request = read_request(data)
    assert request is None or request[0] in {"release", "renew"}
    reply = read_reply(data)
    assert reply is None or 0 <= reply[0] <= 255


def _uri(text: str) -> None:
    """Parse *text* as a lock URI: only ConfigError or UsageError may come of it.

    Whether a message shows a password is test_properties' question (its passwords are
    made to be found); here: redaction hides each secret that shows nowhere else.
    """
    spans = secret_spans(text)
    outside = "".join(
        text[end:start]
        for (_, end), (start, _) in zip([(0, 0), *spans], [*spans, (len(text), 0)], strict=True)
    )
    shown = redact(text)
    for start, end in spans:
        secret = text[start:end]
        if len(secret) >= 4 and secret not in outside and "*" not in secret:
            assert secret not in shown, (text, shown)
    if shown != text:  # what redact() hid cannot pass for a secret (a nested lockrun's URI)
        assert redacted_by_lockrun(shown), (text, shown)
    secrets = secrets_of(text)
    said = scrub(f"{text} {text!r}", secrets)
    for secret in secrets.passwords:
        assert len(secret) < 4 or secret in HIDDEN or secret not in said, (text, said)
    with contextlib.suppress(ConfigError, UsageError):
        open_backend(parse_uri(text), ttl=5.0).close()


def _uri_file(data: bytes) -> None:
    """Read *data* as a --uri-file's content: one line of URI, or ConfigError naming the file."""
    path = os.path.join(_SCRATCH.name, "uri")
    with open(path, "wb") as file:
        file.write(data)
    os.chmod(path, 0o600)
    try:
        uri = read_uri_file(path, "--uri-file")
    except ConfigError as err:
        said = str(err)
    else:
        assert uri == uri.strip()
        assert "\n" not in uri
        return
    assert said.startswith(f"--uri-file {path}: ")


_SCRATCH: Final = tempfile.TemporaryDirectory(prefix="lockrun-fuzz-")  # removed at exit


def _record(text: str, data: bytes) -> None:
    with contextlib.suppress(ValueError):
        Holder.from_dict(read_json(text))
    identity = read_identity(text)
    assert identity is None or identity.slots >= 1
    read_record(data, "x")
    postgres_keys.tagged(text)
    replies.stored_slots(text)
    raw = text.encode(errors="surrogateescape")
    for reply in ([text, text], [raw, raw], [b"flags", raw], {b"flags": raw}, text):
        topology.SentinelView.read(reply, reply, [reply, reply])
        assert cluster.live_replicas(reply) >= 0
        for entry in (reply, [0, 1, reply], [0, 1, [text, raw]], [0, 1, [raw, text, raw]]):
            assert all(0 < port < 65536 for _, port in cluster.primaries_in([entry], ("h", 1)))
            assert all(0 < port < 65536 for _, port in cluster.nodes_in([entry], ("h", 1)))
    assert 0 < next_fence(data) <= MAX_FENCE


def _metrics(data: bytes) -> None:
    """Read *data* as a previous --metrics-file: what survives reads back unchanged."""
    locks = metrics.parse(data)
    assert metrics.parse(metrics.render(locks).encode()) == locks


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.binary(max_size=400))
def fuzz(data: bytes) -> None:
    """Hypothesis's driver of `one_input`."""
    one_input(data)


if __name__ == "__main__":  # pragma: no cover - run by hand, for a long fuzzing session
    if sys.argv[1:2] == ["-atheris"]:
        import atheris  # type: ignore[import-untyped]  # optional: pip install atheris

        atheris.Setup(sys.argv[1:], fuzz.hypothesis.fuzz_one_input)  # type: ignore[attr-defined]
        atheris.Fuzz()
    else:
        fuzz()
