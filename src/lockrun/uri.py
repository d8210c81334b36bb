"""Parse lock URIs and keep their secrets out of every message.

A lock URI may carry a password (or a password-only user name, as in ``redis://SECRET@h``),
typed by hand and often not percent-encoded. Each parser downstream splits such a URI its
own way: RFC 3986 ends the authority at the first ``/``, ``?`` or ``#``, libpq at the first
``@`` or ``/``. A URI on which they could disagree is refused before any of them sees it, and
every message shows `redact`'s form, which hides the whole user information and every
secret option (docs: docs/security.md "Passwords in URIs").

The scheme table lives here too, with what each scheme's backend can do: the CLI, the
runner, `open_backend` and the tests all read `SCHEMES`. This module imports nothing else of
lockrun, so that whatever parses or redacts URIs can use it alone.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Mapping


class URIError(ValueError):
    """A lock URI that is malformed, ambiguous or unknown; the message is safe to print.

    lockrun.backends turns it into a `ConfigError` (exit status 78).
    """


class Scheme(NamedTuple):
    """One URI scheme: its backend, and what that backend holds a lock with."""

    backend: str  # the module under lockrun.backends that serves it
    usage: str  # the URI's form, as --uri's help shows it
    starts: Mapping[str, str]  # what Tab offers for --uri: a start of the URI → what it is
    extra: str | None = None  # the pip extra that brings its driver
    # The lock is an open file description the command inherits: it stays held while the
    # command runs even if lockrun dies, so no guardian is needed unless --close.
    inherits_fds: bool = False
    # The lock is a lease the server expires unless lockrun renews it within --ttl.
    leased: bool = False
    # The lock belongs to a server session: it ends when that connection does.
    session: bool = False

    @property
    def local(self) -> bool:
        """Whether the lock lives on this host: no server, so no user and no password."""
        return not (self.leased or self.session)


# A plain table, no plugin discovery: a backend is a module and rows here (CONTRIBUTING.md).
SCHEMES: Final[Mapping[str, Scheme]] = {
    "file": Scheme(
        "file",
        "file:[///DIR]",
        {"file:": "flock(2) in the default directory", "file:///": "flock(2) in a directory"},
        inherits_fds=True,
    ),
    "abstract": Scheme("abstract", "abstract:[PREFIX]", {"abstract:": "Linux abstract sockets"}),
    "redis": Scheme("redis", "redis://HOST[:PORT][/DB]", {"redis://": "Redis"}, leased=True),
    "rediss": Scheme("redis", "rediss://…", {"rediss://": "Redis over TLS"}, leased=True),
    "unix": Scheme(
        "redis", "unix:///PATH.sock", {"unix:///": "Redis on a unix socket"}, leased=True
    ),
    "redis+sentinel": Scheme(
        "redis",
        "redis+sentinel://H1,H2/SERVICE",
        {"redis+sentinel://": "Redis behind Sentinel"},
        leased=True,
    ),
    "redis+cluster": Scheme(
        "redis",
        "redis+cluster://H1[:PORT],H2[:PORT]",
        {"redis+cluster://": "Redis Cluster"},
        leased=True,
    ),
    "rediss+cluster": Scheme(
        "redis", "rediss+cluster://…", {"rediss+cluster://": "Redis Cluster over TLS"}, leased=True
    ),
    "mysql": Scheme(
        "mysql", "mysql://[USER@]HOST[:PORT]/DB", {"mysql://": "MySQL / MariaDB"}, session=True
    ),
    "mariadb": Scheme("mysql", "mariadb://…", {"mariadb://": "MariaDB / MySQL"}, session=True),
    "postgresql": Scheme(
        "postgres",
        "postgresql://[USER@]HOST[:PORT]/DB (any libpq URI)",
        {"postgresql://": "PostgreSQL"},
        extra="postgres",
        session=True,
    ),
    "postgres": Scheme(
        "postgres", "postgres://…", {"postgres://": "PostgreSQL"}, extra="postgres", session=True
    ),
}
# The backends, in the table's order: what the contract tests and the benchmarks loop over.
BACKENDS: Final = tuple(dict.fromkeys(scheme.backend for scheme in SCHEMES.values()))

DEFAULT_URI: Final = "file:"
LOCAL_SCHEMES: Final = frozenset(name for name, scheme in SCHEMES.items() if scheme.local)
HIDDEN: Final = "***"
_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# A query option whose %-decoded name holds one of these carries a secret
# (password, sslpassword, sentinel_password, …); hiding too much is the safe mistake.
_SECRET_OPTION: Final = ("pass", "secret", "token")
# Every KEY=VALUE after ? or & (overlapping: a value may hide another option); a value runs
# to the next &, as every parser of ours reads it, so a # or ? inside one is hidden with it.
_OPTION: Final = re.compile(r"(?=(?:^|[?&])([^=&?#/]*)=([^&]*))")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_QUERY: Final = re.compile(r"\?([^#]*)")
# Schemes whose path is a file name, where an @ is just a character (unix:///run/a@b.sock).
_PATH_SCHEMES: Final = LOCAL_SCHEMES | {"unix"}
# Where a user information without a colon is often the password (redis://SECRET@host).
_PASSWORD_ONLY: Final = frozenset(n for n, scheme in SCHEMES.items() if scheme.backend == "redis")
_MIN_FRAGMENT: Final = 4  # a run this long of a secret, found in a driver's words, is hidden


class LockURI(NamedTuple):
    """A parsed lock URI; `text` is the original, `redacted` is safe to print."""

    text: str
    scheme: str
    netloc: str  # the authority as written: [USERINFO@]HOSTS
    path: str  # percent-decoded: file:'s directory, abstract:'s prefix
    query: str

    @property
    def redacted(self) -> str:
        """The URI with its user information and secret options replaced by ``***``."""
        return redact(self.text)

    @property
    def userinfo(self) -> str | None:
        """The raw ``USER[:PASSWORD]`` before the authority's ``@``; None if there is none."""
        userinfo, at, _ = self.netloc.rpartition("@")
        return userinfo if at else None

    @property
    def hosts(self) -> str:
        """The authority after its user information."""
        return self.netloc.rpartition("@")[2]

    @property
    def kind(self) -> Scheme:
        """What the registry knows of this URI's scheme and its backend."""
        return SCHEMES[self.scheme]


def parse_uri(text: object) -> LockURI:
    """Parse *text*; raise `URIError` for a malformed, ambiguous or unknown URI."""
    if not isinstance(text, str):
        msg = f"a lock URI must be a string, not {type(text).__name__}"
        raise URIError(msg)
    scheme_match = _known_scheme(text)
    if scheme_match is None:
        known = ", ".join(f"{scheme}:" for scheme in SCHEMES)
        what = "unknown lock URI scheme in" if _SCHEME.match(text) else "malformed lock URI"
        msg = f"{what} {redact(text)!r}; expected {known}"
        raise URIError(msg)
    scheme = scheme_match[0][:-1].lower()
    _refuse_unsafe(text, scheme)
    rest = text[scheme_match.end() :]
    netloc = ""
    if rest.startswith("//"):
        netloc = re.match(r"[^/?#]*", rest[2:])[0]  # type: ignore[index]  # always matches
        rest = rest[2 + len(netloc) :]
    path, _, query = rest.partition("?")
    uri = LockURI(text, scheme, netloc, unquote(path), query)
    if scheme in LOCAL_SCHEMES and uri.userinfo is not None:
        msg = f"{uri.redacted}: {scheme}: URIs take no user name or password"
        raise URIError(msg)
    if redacted_by_lockrun(text):
        msg = (
            f"{uri.redacted}: its password was replaced by {HIDDEN} by the lockrun that runs "
            "this command (no password reaches a command's environment); give this lockrun "
            "the URI itself, with --uri or LOCKRUN_URI"
        )
        raise URIError(msg)
    return uri


def _refuse_unsafe(text: str, scheme: str) -> None:
    """Refuse control characters, fragments, and a user information parsers could split."""
    hint = "percent-encode it"
    problem = None
    if _CONTROL.search(text):
        problem = "holds a control character (a line break, a tab…)"
        hint = "remove it, or percent-encode it"
    elif any("\ud800" <= char <= "\udfff" for char in text):
        problem = "is not valid UTF-8"
        hint = "percent-encode those bytes"
    elif "#" in text:
        problem = "holds a '#', which would start a fragment"
        hint = "write it as %23 (a # in a password, say)"
    elif scheme not in LOCAL_SCHEMES and _at_after_authority(text):
        problem = "has an '@' after the host, or a user or password with '/', '?' or '#'"
        hint = "percent-encode those characters: @ %40, / %2F, ? %3F, # %23, : %3A"
    if problem is not None:
        msg = f"lock URI {redact(text)!r} {problem}: {hint}"
        raise URIError(msg)


def _at_after_authority(text: str) -> bool:
    """Whether an ``@`` lies beyond where RFC 3986 ends the authority.

    Or where no ``//`` began one (``redis:user:pass@host``), or where the authority is empty
    and a query or a path holds the ``@`` (``redis://?pass@host``, ``redis:///pass@host``).
    """
    start, end = _authority_start(text), _userinfo_end(text)
    if end is None:
        return False
    authority = re.match(r"[^/?#]*", text[start:])[0]  # type: ignore[index]  # always matches
    return end >= start + len(authority)


def _userinfo_end(text: str) -> int | None:
    """Return where the user information ends (its last ``@``), hiding too much; or None.

    Where the authority is empty and a path follows, an ``@`` after it is a user
    information typed behind it, but for schemes whose path is a file name. An unescaped
    password may hold a ``#`` or a ``?`` before that ``@`` (``redis:///pw#rd@host``): an
    ``@`` in an option's value (``?host=/run/pg@x``) is the option's.
    """
    start = _authority_start(text)
    if text.startswith("/", start):
        if _scheme_of(text) in _PATH_SCHEMES:
            return None
        path, _, query = text[start:].partition("?")
        at, offset = path.rfind("@"), len(path) + 1
        for item in query.split("&"):
            if "@" in item and "=" not in item.partition("@")[0]:
                at = offset + item.rfind("@")
            offset += len(item) + 1
        return None if at < 0 else start + at
    at = text.rfind("@")
    return at if at > start else None


def _known_scheme(text: str) -> re.Match[str] | None:
    """Match a known scheme and its colon at the start of *text*."""
    match = _SCHEME.match(text)
    return match if match is not None and match[0][:-1].lower() in SCHEMES else None


def _authority_start(text: str) -> int:
    """Return where the authority starts: after ``SCHEME://``, or what stands in for it.

    After ``SCHEME:`` alone (``redis:user:pass@host``); text without a known scheme
    (``alice:secret@host``) is all authority.
    """
    match = _known_scheme(text)
    start = match.end() if match else 0
    return start + 2 if text.startswith("//", start) else start


def host_port(uri: LockURI, text: str, default_port: int) -> tuple[str, int]:
    """Split ``HOST[:PORT]`` or ``[IPV6][:PORT]`` of *uri*; no host means localhost.

    Without a port, *default_port* (0: let the driver decide).
    """
    match = re.fullmatch(r"\[(.+)\](?::(\d*))?|([^:\[\]]*)(?::(\d*))?", text)
    if match is None:
        msg = f"{uri.redacted}: expected HOST[:PORT] or [IPV6][:PORT] after the last @"
        raise URIError(msg)
    host = match[1] or match[3] or "localhost"
    port_text = match[2] if match[1] else match[4]
    if port_text and (len(port_text) > 5 or not 0 < int(port_text) < 65536):  # noqa: PLR2004
        msg = f"{uri.redacted}: port {port_text[:8]} is out of range"
        raise URIError(msg)
    port = int(port_text) if port_text else default_port
    return host, port


def query_items(text: str) -> dict[str, str]:
    """Decode ``a=1&b=2`` as urllib.parse.parse_qsl does (``+`` is a space), last one wins."""
    items = {}
    for item in text.split("&"):
        if item:
            key, _, value = item.partition("=")
            items[unquote(key.replace("+", " "))] = unquote(value.replace("+", " "))
    return items


def option_name(key: str, query: str) -> str:
    """Return how to name option *key* of the raw *query* in a message.

    Only a plain name written as ``KEY=…`` is shown: a careless ``redis://host/0?hunter2``
    makes a password look like an option.
    """
    before = next(  # what follows a secret option may be a piece of it (an unescaped &)
        (
            query[: match.start(2)]
            for match in _OPTION.finditer(query)
            if _is_secret_option(match[1])
        ),
        query,
    )
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,39}", key) and re.search(rf"(?:^|&){key}=", before):
        return repr(key)
    return "(not shown: it could be part of a password)"


def unquote(text: str) -> str:
    """Decode %XX escapes (as UTF-8, like urllib.parse.unquote)."""
    if "%" not in text:
        return text
    encoded = text.encode(errors="surrogatepass")  # argv's undecodable bytes: no error
    raw = re.sub(rb"%([0-9A-Fa-f]{2})", lambda match: bytes([int(match[1], 16)]), encoded)
    return raw.decode(errors="replace")


def _is_secret_option(key: str) -> bool:
    name = unquote(key.replace("+", " ")).lower()
    return any(word in name for word in _SECRET_OPTION)


def secret_spans(text: str) -> list[tuple[int, int]]:
    """Return where *text* holds secrets, as sorted, disjoint, non-empty spans.

    The user information: from where the authority starts to the last ``@``, as an
    unescaped password may hold ``@`` itself (`_userinfo_end`).
    Every query item without ``=``; every secret option (`_SECRET_OPTION`) with all that
    follows; anything after a ``#``. For any string, URI or not: hiding too much is the safe
    mistake.
    """
    spans = []
    start, end = _authority_start(text), _userinfo_end(text)
    if end is not None:
        spans.append((start, end))
    # A query item with no = is no option: a password pasted in the wrong place, maybe.
    query = _QUERY.search(text)
    if query is not None:
        at = query.start(1)
        for item in query[1].split("&"):
            if "=" not in item:
                spans.append((at, at + len(item)))
            at += len(item) + 1
    # A secret option's value runs to the end: an unescaped & may be part of it.
    spans += [
        (match.start(2), len(text))
        for match in _OPTION.finditer(text)
        if _is_secret_option(match[1])
    ]
    if (fragment := text.find("#")) >= 0:
        spans.append((fragment + 1, len(text)))
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(span for span in spans if span[0] < span[1]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def redact(text: str) -> str:
    """Replace the user information and every secret of a URI with ``***``."""
    for start, end in reversed(secret_spans(text)):
        text = f"{text[:start]}{HIDDEN}{text[end:]}"
    return text


def redacted_by_lockrun(text: str) -> bool:
    """Whether *text* is a URI whose secrets `redact` replaced (a nested lockrun's)."""
    return any(text[start:end] == HIDDEN for start, end in secret_spans(text))


class Secrets(NamedTuple):
    """What a URI holds that no output may show."""

    passwords: tuple[str, ...]  # hidden wherever they show, and any 4 characters of them
    names: tuple[str, ...]  # user names (or a password-only user information): where whole


def secrets_of(*texts: str) -> Secrets:
    """Return the secrets of *texts*: each as written and %-decoded, longest first.

    The password of the user information, the user information without one (the
    password-only ``redis://SECRET@h`` form, or a user name), the user name, and the value
    of every secret option.
    """
    passwords: set[str] = set()
    names: set[str] = set()
    for text in texts:
        for index, (start, end) in enumerate(secret_spans(text)):
            raw = text[start:end]
            if index == 0 and _is_userinfo(text, start):
                user, colon, password = raw.partition(":")
                if not colon and _scheme_of(text) in _PASSWORD_ONLY:
                    password = user  # redis://SECRET@host: a password, however redis-py reads it
                else:
                    names |= {user, unquote(user)}
                passwords |= {password, unquote(password)}
            else:
                passwords |= {raw, unquote(raw)}
    return Secrets(_longest_first(passwords), _longest_first(names - passwords))


def _scheme_of(text: str) -> str:
    match = _known_scheme(text)
    return "" if match is None else match[0][:-1].lower()


def _is_userinfo(text: str, start: int) -> bool:
    return start == _authority_start(text) and "@" in text[start:]


def _longest_first(pieces: set[str]) -> tuple[str, ...]:
    return tuple(sorted((piece for piece in pieces if piece), key=lambda p: (-len(p), p)))


def scrub(text: str, secrets: Secrets) -> str:
    """Hide what *text* (a driver's or a server's words) shows of *secrets*.

    Each secret where it shows whole (a short name only quoted alone: ``user 'ci'``), then
    any run of four characters of one: a driver may quote a piece, a server cut a name.
    """
    for password in secrets.passwords:  # whole first, the longest first
        text = text.replace(password, HIDDEN)
    for name in secrets.names:
        if len(name) >= _MIN_FRAGMENT:
            text = text.replace(name, HIDDEN)
        for quote in "'\"":
            text = text.replace(f"{quote}{name}{quote}", f"{quote}{HIDDEN}{quote}")
    for secret in secrets.passwords + secrets.names:  # a server may cut a long name short
        for at in range(len(secret) - _MIN_FRAGMENT + 1):
            text = text.replace(secret[at : at + _MIN_FRAGMENT], HIDDEN)
    return text
