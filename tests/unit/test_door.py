"""The keeper's wire (lockrun.door), in-process: the token, the messages, and `ask`.

`ask` is tried against a door this test binds and serves from a thread: the keeper's side of
the conversation is the test's, so each answer a keeper (or a squatter, or nothing) can give
is given on purpose. docs/security.md says who may ask what.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun import door
from lockrun.door import (
    BUSY,
    MAX_REPLY,
    MAX_REQUEST,
    Grant,
    Token,
    answer,
    ask,
    grant_message,
    parse_token,
    peer_uid,
    read_grant,
    read_reply,
    read_request,
)
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    ExitCode,
    LeaseLost,
    NotYours,
    TakenOver,
    TimedOut,
    UsageError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

MAX_UID = 2**32 - 2
tokens = st.builds(
    Token,
    uid=st.integers(0, MAX_UID),
    keeper=st.from_regex(r"[0-9a-f]{16}", fullmatch=True),
    secret=st.from_regex(r"[A-Za-z0-9_-]{24}", fullmatch=True),
)
fences = st.none() | st.integers(0, 2**63 - 1)


# -- the token ------------------------------------------------------------------------------


@given(tokens)
def test_a_printed_token_parses_back_to_itself(token: Token) -> None:
    """What `acquire` prints, `release` reads back: uid, keeper id and secret."""
    assert parse_token(str(token)) == token


@given(st.text(max_size=80))
def test_any_text_is_a_token_spelled_one_way_or_a_usage_error(text: str) -> None:
    """Forged text is refused (64); accepted text has one spelling, the printed one."""
    try:
        token = parse_token(text)
    except UsageError:
        return
    assert str(token) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "lr1.0.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA ",  # a trailing blank
        "lr2.0.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA",  # another version
        "lr1.00.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA",  # a uid spelled twice
        "lr1.0.0123456789ABCDEF.AAAAAAAAAAAAAAAAAAAAAAAA",  # upper-case id
        "lr1.0.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAA",  # a secret one short
        "lr1.0.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAA=",  # base64's padding
        f"lr1.{MAX_UID + 1}.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA",  # (uid_t) -1
        "lr1.٣.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA",  # a digit, but not ASCII
    ],
)
def test_forged_tokens_are_usage_errors(text: str) -> None:
    """Anything `acquire` did not print is 64, before any door is knocked on."""
    with pytest.raises(UsageError, match="malformed token"):
        parse_token(text)


@pytest.mark.parametrize("value", [None, 42, b"lr1.0.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA"])
def test_a_token_that_is_no_text_is_a_usage_error(value: object) -> None:
    """Bytes or None from a caller of the API: 64, not a TypeError from re."""
    with pytest.raises(UsageError):
        parse_token(value)


def test_the_highest_uid_is_a_token_uid() -> None:
    """2**32 - 2 is a user; one more is no one's."""
    text = f"lr1.{MAX_UID}.0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA"
    assert parse_token(text).uid == MAX_UID


def test_a_new_token_is_ours_fresh_and_printable() -> None:
    """Our euid, a fresh id and secret each time, and it parses back."""
    first, second = Token.new(), Token.new()
    assert first.uid == os.geteuid()
    assert first.keeper != second.keeper
    assert first.secret != second.secret
    assert parse_token(str(first)) == first


def test_a_tokens_door_is_an_abstract_name_of_its_keeper() -> None:
    """A leading NUL: no file to leave behind; one name per keeper id, none per secret."""
    token = Token.new()
    assert token.door.startswith(b"\0")
    assert token.door.endswith(token.keeper.encode())
    assert token.door == token._replace(secret="x" * 24).door
    assert token.door != Token.new().door


# -- the grant ------------------------------------------------------------------------------


@given(tokens, fences)
def test_a_grant_reads_back_as_sent(token: Token, fence: int | None) -> None:
    """The parent reads the keeper's token and fence as the keeper sent them."""
    assert read_grant(grant_message(Grant(token, fence))) == Grant(token, fence)


def test_a_grant_without_a_fence_says_so_with_a_dash() -> None:
    """A backend with no fence: "-", not "None" nor a number the parent would print."""
    token = Token.new()
    assert grant_message(Grant(token, None)) == f"granted {token} -".encode()
    assert grant_message(Grant(token, 0)) == f"granted {token} 0".encode()


@pytest.mark.parametrize("message", [b"", door.NACK, door.ACK, door.HELD, b"grant x 1"])
def test_anything_but_a_grant_is_no_grant(message: bytes) -> None:
    """The keeper ended without the lock: None, for the parent to report its status."""
    assert read_grant(message) is None


def test_a_grant_with_a_forged_token_is_refused() -> None:
    """A grant is read with the token's own parser: a bad one is 64, not a token printed."""
    with pytest.raises(UsageError):
        read_grant(b"granted lr1.0.nothex.secret 3")


# -- requests and replies -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "parsed"),
    [
        (b"release s3cret", ("release", "s3cret")),
        (b"renew s3cret", ("renew", "s3cret")),
        (b"release a b", ("release", "a b")),  # the secret is compared whole, blanks and all
    ],
)
def test_a_request_is_a_verb_and_a_secret(data: bytes, parsed: tuple[str, str]) -> None:
    """``VERB SECRET``: the keeper reads both, and compares the secret itself."""
    assert read_request(data) == parsed


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"stop s3cret",
        b"RELEASE s3cret",
        b"release s3cr\xc3\xa9t",  # a secret is ASCII
        b"rel\xffease s3cret",
        b"release " + b"x" * MAX_REQUEST,
    ],
)
def test_a_request_that_is_none_of_ours_is_none(data: bytes) -> None:
    """Another verb, a secret that is not ASCII, or junk too long: none (never a traceback)."""
    assert read_request(data) is None


def test_the_longest_request_is_read() -> None:
    """`MAX_REQUEST` bytes is still a request; the bound is not off by one."""
    data = b"renew " + b"x" * (MAX_REQUEST - len(b"renew "))
    assert len(data) == MAX_REQUEST
    assert read_request(data) == ("renew", "x" * (MAX_REQUEST - 6))


@pytest.mark.parametrize(
    ("data", "reply"),
    [
        (b"0 released nightly", (0, "released nightly")),
        (b"76 gone", (76, "gone")),
        (b"69 " + BUSY.encode(), (69, BUSY)),
        (b"124 late", (124, "late")),
        (b"64 not a request a keeper answers", (64, "not a request a keeper answers")),
        (b"0", (0, "")),
        (b"0 caf\xff", (0, "caf\ufffd")),  # a message that is not UTF-8 is shown, replaced
    ],
)
def test_a_reply_is_a_status_and_a_message(data: bytes, reply: tuple[int, str]) -> None:
    """``STATUS MESSAGE``, a status a keeper gives."""
    assert read_reply(data) == reply


@pytest.mark.parametrize(
    "data",
    [b"", b"ok", b"1 x", b"200 x", b"-1 x", b"0070 x", b" 0 x", b"\xd9\xa0 x", b"0 " + b"x" * 1023],
)
def test_a_reply_no_keeper_gives_is_none(data: bytes) -> None:
    """A status a keeper never gives, a number spelled oddly, or more than MAX_REPLY: none."""
    assert read_reply(data) is None


def test_the_longest_reply_is_read() -> None:
    """`MAX_REPLY` bytes is still an answer."""
    data = b"0 " + b"x" * (MAX_REPLY - 2)
    assert read_reply(data) == (0, "x" * (MAX_REPLY - 2))


# -- the socket's end -----------------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_peer_uid_is_the_uid_of_the_other_end() -> None:
    """SO_PEERCRED: on a pair of our own, both ends are us."""
    ours, theirs = _pair()
    with ours, theirs:
        assert peer_uid(ours) == os.geteuid()
        assert peer_uid(theirs) == os.geteuid()


def test_an_answer_is_status_then_message() -> None:
    """The keeper's answer reads back as the status and message it gave."""
    keeper, client = _pair()
    with keeper, client:
        answer(keeper, ExitCode.LOST, "lost nightly")
        assert client.recv(MAX_REPLY + 1) == b"76 lost nightly"


def test_an_answer_is_cut_to_max_reply() -> None:
    """A long message never reaches a client as more than it reads."""
    keeper, client = _pair()
    with keeper, client:
        answer(keeper, 0, "x" * (2 * MAX_REPLY))
        data = client.recv(4 * MAX_REPLY)
        assert len(data) == MAX_REPLY
        assert read_reply(data) == (0, "x" * (MAX_REPLY - 2))


def test_an_answer_to_a_client_that_does_not_read_never_blocks() -> None:
    """A full peer: the answer is dropped, the keeper goes on (it serves one door alone)."""
    keeper, client = _pair()
    with keeper, client:
        keeper.setblocking(False)  # noqa: FBT003 - filling it must not block the test
        with contextlib.suppress(BlockingIOError):
            while True:
                keeper.send(b"x" * 4096)
        keeper.setblocking(True)  # noqa: FBT003 - as the keeper's is: MSG_DONTWAIT saves it
        answer(keeper, 0, "released")  # returns, and raises nothing
        client.setblocking(False)  # noqa: FBT003 - read what is there, then stop
        messages = []
        with contextlib.suppress(BlockingIOError):
            while True:
                messages.append(client.recv(8192))
        assert messages
        assert set(messages) == {b"x" * 4096}  # the fill only: no answer came late


def test_an_answer_to_a_client_that_hung_up_raises_nothing() -> None:
    """EPIPE is the client's loss, not the keeper's end."""
    keeper, client = _pair()
    client.close()
    with keeper:
        answer(keeper, 0, "released")


# -- ask, against a door served here --------------------------------------------------------


@contextlib.contextmanager
def keeper(
    serve: Callable[[socket.socket, int], None], token: Token | None = None
) -> Iterator[Token]:
    """Bind *token*'s door and call *serve* with each connection and its number."""
    token = token or Token.new()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(token.door)
    listener.listen(128)  # room for every asking (one each 10 ms) of a 1 s ANSWER: never EAGAIN
    listener.settimeout(0.05)
    done = threading.Event()

    def loop() -> None:
        number = 0
        while not done.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(10)
                serve(connection, number)
            number += 1

    with listener, ThreadPoolExecutor(max_workers=1) as pool:
        served = pool.submit(loop)
        try:
            yield token
        finally:
            done.set()
            served.result(timeout=30)  # a failed assertion of *serve* fails the test


def replying(data: bytes, heard: list[bytes]) -> Callable[[socket.socket, int], None]:
    """Serve every connection: read its request into *heard*, then send *data*."""

    def serve(connection: socket.socket, _number: int) -> None:
        heard.append(connection.recv(MAX_REQUEST + 1))
        connection.send(data)

    return serve


def test_ask_sends_the_verb_and_secret_and_returns_the_keepers_line() -> None:
    """Asked once, answered once: the line is the keeper's message."""
    heard: list[bytes] = []
    with keeper(replying(b"0 released nightly after 3s", heard)) as token:
        assert ask(str(token), "release") == "released nightly after 3s"
    assert heard == [f"release {token.secret}".encode()]


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (ExitCode.LOST, LeaseLost),
        (ExitCode.NOPERM, NotYours),
        (ExitCode.CONFIG, ConfigError),
        (ExitCode.TAKEN_OVER, TakenOver),
        (ExitCode.TIMEOUT, TimedOut),
        (ExitCode.UNAVAILABLE, BackendUnavailable),
    ],
)
def test_ask_raises_the_status_the_keeper_answered(status: int, error: type[Exception]) -> None:
    """The keeper's status becomes the client's, its message the error's."""
    heard: list[bytes] = []
    with (
        keeper(replying(f"{status} the keeper says so".encode(), heard)) as token,
        pytest.raises(error, match="the keeper says so") as raised,
    ):
        ask(str(token), "renew")
    assert getattr(raised.value, "exit_code", None) == status
    assert heard == [f"renew {token.secret}".encode()]


def test_ask_asks_again_while_the_keeper_is_busy() -> None:
    """BUSY, unread, twice: the third asking is read and answered, and that answer returned."""
    heard: list[bytes] = []

    def serve(connection: socket.socket, number: int) -> None:
        if number < 2:  # turned away without reading, as a keeper with a crowd does
            answer(connection, ExitCode.UNAVAILABLE, BUSY)
            return
        heard.append(connection.recv(MAX_REQUEST + 1))
        answer(connection, 0, "renewed")

    with keeper(serve) as token:
        assert ask(str(token), "renew") == "renewed"
    assert heard == [f"renew {token.secret}".encode()]


def test_ask_asks_again_when_the_keeper_hangs_up_unread() -> None:
    """Hung up before reading: the request was never carried out, so it is asked again."""
    heard: list[bytes] = []

    def serve(connection: socket.socket, number: int) -> None:
        if number == 0:
            return  # closed without a word
        heard.append(connection.recv(MAX_REQUEST + 1))
        answer(connection, 0, "released")

    with keeper(serve) as token:
        assert ask(str(token), "release") == "released"
    assert heard == [f"release {token.secret}".encode()]


def test_a_keeper_that_always_hangs_up_is_unavailable_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Never an answer until ANSWER is up: 69, saying it hung up."""
    monkeypatch.setattr(
        door, "ANSWER", 1.0
    )  # at least one asking is answered, however loaded the machine
    with (
        keeper(lambda _connection, _number: None) as token,
        pytest.raises(BackendUnavailable, match="hung up without an answer") as raised,
    ):
        ask(str(token), "release")
    assert raised.value.exit_code == ExitCode.UNAVAILABLE


def test_a_keeper_that_stays_busy_is_unavailable_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BUSY until ANSWER is up: its BUSY is the status, 69."""
    monkeypatch.setattr(door, "ANSWER", 1.0)

    def serve(connection: socket.socket, _number: int) -> None:
        connection.recv(MAX_REQUEST + 1)  # read: its BUSY is then surely the last word
        answer(connection, ExitCode.UNAVAILABLE, BUSY)

    with keeper(serve) as token, pytest.raises(BackendUnavailable, match="busy; ask again"):
        ask(str(token), "renew")


def test_a_keeper_that_never_answers_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read but never answered: 69 once ANSWER is up, not a hang."""
    monkeypatch.setattr(door, "ANSWER", 0.3)
    release = threading.Event()

    def serve(connection: socket.socket, _number: int) -> None:
        connection.recv(MAX_REQUEST + 1)
        release.wait(30)

    with keeper(serve) as token:
        try:
            with pytest.raises(BackendUnavailable, match="did not answer within"):
                ask(str(token), "release")
        finally:
            release.set()


def test_a_reply_that_is_no_keepers_is_unavailable() -> None:
    """An answer no keeper gives: 69, and never taken for a success."""
    heard: list[bytes] = []
    with (
        keeper(replying(b"HTTP/1.1 200 OK", heard)) as token,
        pytest.raises(BackendUnavailable, match="none a keeper gives"),
    ):
        ask(str(token), "release")


def test_no_keeper_at_the_door_is_a_lost_lease() -> None:
    """Nothing listens on the token's name: 76, with what may have happened."""
    with pytest.raises(LeaseLost, match="no keeper holds a lock for this token") as raised:
        ask(str(Token.new()), "renew")
    assert raised.value.exit_code == ExitCode.LOST


def test_a_forged_token_is_refused_before_any_door(monkeypatch: pytest.MonkeyPatch) -> None:
    """64, and no socket is even made."""

    def no_socket(*_args: object) -> None:
        pytest.fail("a socket was made for a forged token")

    monkeypatch.setattr(socket, "socket", no_socket)
    with pytest.raises(UsageError):
        ask("lr1.nonsense", "release")


def test_another_users_token_is_not_ours_without_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root, and the token's uid is another's: 77 at once (it would not answer us)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    token = Token(2000, "0123456789abcdef", "A" * 24)
    with pytest.raises(NotYours, match=r"another user \(uid 2000\)"):
        ask(str(token), "release")


def test_a_squatter_on_a_keepers_name_is_neither_told_the_secret_nor_believed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A door held by another uid than the token's: 76, and the secret was never sent."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root may ask any user's keeper
    heard: list[bytes] = []
    squatted = Token(4242 if os.getuid() != 4242 else 4243, Token.new().keeper, "S" * 24)

    def serve(connection: socket.socket, _number: int) -> None:
        connection.settimeout(0.5)
        with contextlib.suppress(TimeoutError, OSError):
            heard.append(connection.recv(MAX_REQUEST + 1))
        answer(connection, 0, "released")

    with (
        keeper(serve, squatted),
        pytest.raises(LeaseLost, match="listens on its name instead, and was not asked"),
    ):
        ask(str(squatted), "release")
    assert all(b"S" * 24 not in data for data in heard)


def test_every_status_the_keeper_answers_is_one_a_client_reads() -> None:
    """Both sides of the door agree: each `answer(…, ExitCode.X, …)` in the keeper reads back.

    A status the client does not know would turn the keeper's word into "none a keeper
    gives" (69): the keeper's junk answer (64) once did.
    """
    import ast
    import inspect

    from lockrun import keeper

    answered = {
        ExitCode[node.args[1].attr]
        for node in ast.walk(ast.parse(inspect.getsource(keeper)))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "answer"
        and isinstance(node.args[1], ast.Attribute)
    }
    assert answered  # the keeper does answer with named statuses
    for status in answered:
        assert read_reply(f"{int(status)} said".encode()) == (int(status), "said")
