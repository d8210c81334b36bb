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

import codecs
import re
import threading
from typing import TYPE_CHECKING, Final, Literal, NamedTuple, get_args

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping


class URIError(ValueError):
    """A lock URI that is malformed, ambiguous or unknown; the message is safe to print.

    lockrun.backends turns it into a `ConfigError` (exit status 78).
    """


# The fleet modes a backend may offer, as the command line spells them after "--"
# (docs/semantics.md "Fleet modes"); the Python API spells them with "_".
Mode = Literal["shared", "hold-at-least", "take-over"]
MODES: Final[frozenset[Mode]] = frozenset(get_args(Mode))


class Scheme(NamedTuple):
    """One URI scheme: its backend, what that backend holds a lock with, and what it offers."""

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
    # The fleet modes its backend offers; any other is refused before anything is opened
    # (`lockrun.bounds.check_modes`), so a new backend can start with none.
    modes: frozenset[Mode] = frozenset()
    # It can leave a lock held with no process (`lockrun acquire --no-keeper`): the server
    # keeps the lease, and the backend is a `lockrun.backends.Detachable`.
    detachable: bool = False
    # Its backend tells `Request.waiting` as it begins to wait: the run's guardian is forked
    # then, or once the lock is held, rather than before the run connects (docs/design.md
    # A11). Only where no connection holds the lock: the guardian drops those it inherits.
    tells_waiting: bool = False

    @property
    def local(self) -> bool:
        """Whether the lock lives on this host: no server, so no user and no password."""
        return not (self.leased or self.session)


# A plain table, no plugin discovery: a backend is a module and rows here (CONTRIBUTING.md).
# abstract: declines --hold-at-least and --take-over: it stores nothing, and a window would
# need a process of its own, a take-over a bell on every holder (docs/design.md A3).
SCHEMES: Final[Mapping[str, Scheme]] = {
    "file": Scheme(
        "file",
        "file:[///DIR]",
        {"file:": "flock(2) in the default directory", "file:///": "flock(2) in a directory"},
        inherits_fds=True,
        modes=MODES,
    ),
    "abstract": Scheme(
        "abstract",
        "abstract:[PREFIX]",
        {"abstract:": "Linux abstract sockets"},
        modes=frozenset({"shared"}),
    ),
    "redis": Scheme(
        "redis",
        "redis://HOST[:PORT][/DB]",
        {"redis://": "Redis"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "rediss": Scheme(
        "redis",
        "rediss://…",
        {"rediss://": "Redis over TLS"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "unix": Scheme(
        "redis",
        "unix:///PATH.sock",
        {"unix:///": "Redis on a unix socket"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "redis+sentinel": Scheme(
        "redis",
        "redis+sentinel://H1,H2/SERVICE",
        {"redis+sentinel://": "Redis behind Sentinel"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "redis+cluster": Scheme(
        "redis",
        "redis+cluster://H1[:PORT],H2[:PORT]",
        {"redis+cluster://": "Redis Cluster"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "rediss+cluster": Scheme(
        "redis",
        "rediss+cluster://…",
        {"rediss+cluster://": "Redis Cluster over TLS"},
        leased=True,
        modes=MODES,
        detachable=True,
    ),
    "mysql": Scheme(
        "mysql",
        "mysql://[USER@]HOST[:PORT]/DB",
        {"mysql://": "MySQL / MariaDB"},
        session=True,
        modes=MODES,
    ),
    "mariadb": Scheme(
        "mysql", "mariadb://…", {"mariadb://": "MariaDB / MySQL"}, session=True, modes=MODES
    ),
    "postgresql": Scheme(
        "postgres",
        "postgresql://[USER@]HOST[:PORT]/DB (any libpq URI)",
        {"postgresql://": "PostgreSQL"},
        extra="postgres",
        session=True,
        modes=MODES,
    ),
    "postgres": Scheme(
        "postgres",
        "postgres://…",
        {"postgres://": "PostgreSQL"},
        extra="postgres",
        session=True,
        modes=MODES,
    ),
    "etcd": Scheme(
        "etcd",
        "etcd://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]",
        {"etcd://": "etcd"},
        leased=True,
        modes=MODES,
        detachable=True,
        tells_waiting=True,
    ),
    "etcds": Scheme(
        "etcd",
        "etcds://…",
        {"etcds://": "etcd over TLS"},
        leased=True,
        modes=MODES,
        detachable=True,
        tells_waiting=True,
    ),
}
# The backends, in the table's order: what the contract tests and the benchmarks loop over.
BACKENDS: Final = tuple(dict.fromkeys(scheme.backend for scheme in SCHEMES.values()))

DEFAULT_URI: Final = "file:"
LOCAL_SCHEMES: Final = frozenset(name for name, scheme in SCHEMES.items() if scheme.local)
HIDDEN: Final = "***"
# The regular expressions below are source text, compiled on first use (re.compile keeps
# them): compiled at import, they were a tenth of a file: run's start-up (issue #32).
_SCHEME: Final = r"[A-Za-z][A-Za-z0-9+.-]*:"
# A KEY=VALUE whose %-decoded KEY holds one of these, in any case, carries a secret
# (password, passwd, sslpassword, sentinel_password, pwd, auth, token, client_secret…);
# hiding too much is the safe mistake.
_SECRET_OPTION: Final = ("pass", "pwd", "secret", "token", "auth")
# A KEY=VALUE anywhere: a query's option, a libpq conninfo's (`key = 'value'`), or one
# nested in a value; the KEY is what stands before the = up to a separator.
_KEYED: Final = r"(?<![^\s=&?#/;,'\"])([^\s=&?#/;,'\"]+)\s*=\s*"  # linear: from a start
# A URI inside other text (a conninfo in ?dbname=, a driver's words): its authority.
_EMBEDDED: Final = r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://([^/?#\s'\"]*)"
# What each of an authority's comma-separated hosts may be, after its user information:
# HOST[:PORT] or [IPV6][:PORT]. Anything else may be a secret: ``redis://user:password``
# with no @HOST, or ``redis://user:/password`` (a colon with no port, then a path).
_HOST: Final = r"(?:\[[0-9A-Fa-f:.]*(?:%25[\w.~%-]*)?\]|[^:\[\]]*)(?::[0-9]{1,5})?"
_ESCAPE: Final = r"%([0-9A-Fa-f]{2})"
_ESCAPES: Final = r"(?:%[0-9A-Fa-f]{2})+"
_WORD: Final = r"[^\s&;]*"  # a value as far as it surely goes
_QUOTED: Final = r"(?s)'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\""  # libpq's
_ESCAPED: Final = r"(?s)\\(.)"
_DECODINGS: Final = 4  # the text and three %-decodings of it: %252525… is its writer's business
_CONTROL: Final = r"[\x00-\x1f\x7f]"
_QUERY: Final = r"\?([^#]*)"
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

    def __repr__(self) -> str:
        """Show the URI as `redacted`: a repr() lands in tracebacks and logs."""
        return f"LockURI({self.redacted!r})"

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
        what = (
            "unknown lock URI scheme in"
            if re.compile(_SCHEME).match(text)
            else "malformed lock URI"
        )
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
    remember(text)
    return uri


def _refuse_unsafe(text: str, scheme: str) -> None:
    """Refuse control characters, fragments, and a user information parsers could split."""
    hint = "percent-encode it"
    problem = None
    if re.compile(_CONTROL).search(text):
        problem = "holds a control character (a line break, a tab…)"
        hint = "remove it, or percent-encode it"
    elif any("\ud800" <= char <= "\udfff" for char in text):
        problem = "is not valid UTF-8"
        hint = "percent-encode those bytes"
    elif "#" in text:
        problem = "holds a '#', which would start a fragment"
        hint = "write it as %23 (a # in a password, say)"
    elif scheme not in _PATH_SCHEMES and not text.startswith("//", len(scheme) + 1):
        problem = f"has no '//' after '{scheme}:'"
        hint = f"write {SCHEMES[scheme].usage}"
    elif scheme not in LOCAL_SCHEMES and _at_after_authority(text):
        problem = "has an '@' after the host, or a user or password with '/', '?' or '#'"
        hint = "percent-encode those characters: @ %40, / %2F, ? %3F, # %23, : %3A"
    elif _userinfo_end(text) is None and _loose_authority(text, _Found(text)):
        problem = "has no HOST[:PORT] or [IPV6][:PORT] after '//': a USER:PASSWORD with no '@'?"
        hint = "write USER:PASSWORD@HOST[:PORT]"
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
    match = re.compile(_SCHEME).match(text)
    return match if match is not None and match[0][:-1].lower() in SCHEMES else None


def _authority_start(text: str) -> int:
    """Return where the authority starts: after ``SCHEME://``, or what stands in for it.

    After ``SCHEME:`` alone (``redis:user:pass@host``), or after an unknown scheme's
    ``SCHEME://``; other text without a known scheme (``alice:secret@host``) is all
    authority.
    """
    match = _known_scheme(text) or re.compile(_SCHEME).match(text)
    start = match.end() if match else 0
    if text.startswith("//", start):
        return start + 2
    return start if _known_scheme(text) else 0


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
    spans = secret_spans(f"?{query}")  # what follows a secret may be a piece of it
    before = query[: max(spans[0][0] - 1, 0)] if spans else query
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


class _Found:
    """Where a text holds secrets, and each secret as a driver might quote it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.spans: list[tuple[int, int]] = []
        self.passwords: set[str] = set()
        self.names: set[str] = set()
        self.marked = False  # whether a secret of it is HIDDEN already: `redact`'s work
        self.rest = len(text)  # where the first secret that runs to the end starts

    def hide_rest(self, at: int, view: str, view_at: int) -> None:
        """Hide from *at* to the end; *view_at* is where that is in *view*, a %-decoding.

        A rest after the first is a piece of the first: its every four characters are
        hidden already (`scrub`), so it is not kept again (which would take quadratic time).
        """
        self.spans.append((at, len(self.text)))
        if at < self.rest:
            self.rest = at
            self.passwords |= {self.text[at:], view[view_at:]}


def _find(text: str) -> _Found:
    """Find every secret of *text*, a URI or a conninfo string or anything at all.

    In the URI itself: the user information, an authority that is no HOST[:PORT] list
    (``redis://user:password``, with no @HOST), query items without ``=`` and a fragment.
    In the text and in each of its %-decodings: a KEY=VALUE whose KEY names a secret and a
    URI with a user information or such an authority, each with all that follows (an
    unescaped ``&`` or a quote may belong to it).
    """
    found = _Found(text)
    start, end = _authority_start(text), _userinfo_end(text)
    if end is not None:
        found.spans.append((start, end))
        _split_userinfo(text[start:end], found, password_only=_scheme_of(text) in _PASSWORD_ONLY)
    elif (authority := _loose_authority(text, found)) is not None:
        found.hide_rest(start, text, start)
        _split_userinfo(authority, found, password_only=False)
    # A query item with no = is no option: a password pasted in the wrong place, maybe.
    query = re.compile(_QUERY).search(text)
    if query is not None:
        at = query.start(1)
        for item in query[1].split("&"):
            if "=" not in item:
                found.spans.append((at, at + len(item)))
                found.passwords.add(item)
            at += len(item) + 1
    if (fragment := text.find("#")) >= 0:
        found.hide_rest(fragment + 1, text, fragment + 1)
    for view, where in _views(text):
        _find_in_view(text, view, where, found, own=True)
    return found


def _find_in_view(text: str, view: str, where: list[int], found: _Found, *, own: bool) -> None:
    """Find the secret options and the URIs with secrets of *view*, a %-decoding of *text*.

    *where* maps each position of *view* to one of *text*; *own*: a URI that starts *text*
    is its own, not one inside it.
    """
    for match in re.compile(_KEYED).finditer(view):
        if _is_secret_option(match[1]):
            found.hide_rest(where[match.end()], view, match.end())
            _add_value(view, match.end(), found)
    for match in re.compile(_EMBEDDED).finditer(view):
        userinfo, sign, hosts = match[1].rpartition("@")
        scheme = view[match.start() : match.start(1)]
        inside = not own or where[match.start()] > 0 or not text.startswith(scheme)
        if inside and (sign or not _plain(hosts, found)):
            found.hide_rest(where[match.start(1)], view, match.start(1))
            _split_userinfo(userinfo or hosts, found, password_only=True)
            found.marked |= userinfo == HIDDEN


def _loose_authority(text: str, found: _Found) -> str | None:
    """Return the authority of *text*, which has no user information, if it is no hosts.

    Not a list of HOST[:PORT]: ``redis://user:password``, with no @HOST. A local scheme's
    text after ``SCHEME:`` alone is a path or a prefix.
    """
    scheme = _scheme_of(text)
    if scheme in LOCAL_SCHEMES and not text.startswith("//", len(scheme) + 1):
        return None
    authority = re.match(r"[^/?#]*", text[_authority_start(text) :])[0]  # type: ignore[index]
    return None if _plain(authority, found) else authority


def _plain(hosts: str, found: _Found) -> bool:
    """Whether *hosts* is a comma-separated list of HOST[:PORT] (marking a HIDDEN one)."""
    found.marked |= hosts == HIDDEN
    return all(re.compile(_HOST).fullmatch(host) for host in hosts.split(","))


def _split_userinfo(raw: str, found: _Found, *, password_only: bool) -> None:
    """Add the user name and password of *raw* (``USER[:PASSWORD]``) to *found*.

    A user information without a colon is the password where it often is one
    (``redis://SECRET@host``).
    """
    user, colon, password = raw.partition(":")
    if not colon and password_only:
        user, password = "", user
    found.names.add(user)
    found.passwords.add(password)


def _add_value(view: str, at: int, found: _Found) -> None:
    r"""Add the value of a secret option at *at* of *view* to *found*: to a separator, unquoted.

    libpq reads ``key='a b\'c'`` as ``a b'c``; a URI's option ends at ``&``.
    """
    found.passwords.add(re.compile(_WORD).match(view, at)[0])  # type: ignore[index]  # always matches
    if (quoted := re.compile(_QUOTED).match(view, at)) is not None:
        found.passwords.add(re.compile(_ESCAPED).sub(r"\1", quoted[1] or quoted[2] or ""))


def _views(text: str) -> Iterator[tuple[str, list[int]]]:
    """Yield *text* and its %-decodings, each with where its characters are in *text*."""
    view, where = text, list(range(len(text) + 1))
    for _ in range(_DECODINGS):
        yield view, where
        if not re.compile(_ESCAPE).search(view):
            return
        view, where = _decoded(view, where)


def _decoded(view: str, where: list[int]) -> tuple[str, list[int]]:
    """Decode the %XX escapes of *view* as UTF-8; map each character to its first byte's place."""
    chars: list[str] = []
    places: list[int] = []
    at = 0
    for run in re.compile(_ESCAPES).finditer(view):
        chars.append(view[at : run.start()])
        places += where[at : run.start()]
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        first = where[run.start()]
        for byte in range(run.start(), run.end(), 3):
            if not decoder.getstate()[0]:  # the first byte of a character
                first = where[byte]
            out = decoder.decode(bytes([int(view[byte + 1 : byte + 3], 16)]))
            chars.append(out)
            places += [first] * len(out)
        out = decoder.decode(b"", final=True)
        chars.append(out)
        places += [first] * len(out)
        at = run.end()
    chars.append(view[at:])
    places += where[at:]  # and where the end of *view* is
    return "".join(chars), places


def secret_spans(text: str) -> list[tuple[int, int]]:
    """Return where *text* holds secrets (`_find`), as sorted, disjoint, non-empty spans.

    For any string, URI or not: hiding too much is the safe mistake.
    """
    return _merged(_find(text).spans)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(span for span in spans if span[0] < span[1]):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def redact(text: str) -> str:
    """Replace the user information and every secret of a URI with ``***``."""
    return _hidden(text, secret_spans(text))


def _hidden(text: str, spans: list[tuple[int, int]]) -> str:
    for start, end in reversed(spans):
        text = f"{text[:start]}{HIDDEN}{text[end:]}"
    return text


def redacted_by_lockrun(text: str) -> bool:
    """Whether *text* is a URI whose secrets `redact` replaced (a nested lockrun's)."""
    found = _find(text)
    return found.marked or any(text[start:end] == HIDDEN for start, end in found.spans)


class Secrets(NamedTuple):
    """What a URI holds that no output may show."""

    passwords: tuple[str, ...]  # hidden wherever they show, and any 4 characters of them
    names: tuple[str, ...]  # user names (or a password-only user information): where whole


def secrets_of(*texts: str) -> Secrets:
    """Return the secrets of *texts* (`_find`): each as written and %-decoded, longest first.

    The password of the user information, or the user information without one (the
    password-only ``redis://SECRET@h`` form), the value of every secret option, as written
    and unquoted, and all that follows it; user names apart.
    """
    passwords: set[str] = set()
    names: set[str] = set()
    for text in texts:
        found = _find(text)
        for pieces, into in ((found.passwords, passwords), (found.names, names)):
            for piece in pieces:
                into |= {piece, unquote(piece), unquote(piece.replace("+", " "))}
    passwords.discard(HIDDEN)
    return Secrets(_longest_first(passwords), _longest_first(names - passwords - {HIDDEN}))


# The passwords of the last URIs this process parsed, which `hide` hides in LockrunError's
# messages (the CLI's stderr and the Python API's exceptions alike): the last line of
# defence, should a message quote an option's value that holds a secret.
_REMEMBERED: Final[dict[str, tuple[str, ...]]] = {}
_REMEMBERED_URIS: Final = 16
_REMEMBERING: Final = threading.Lock()


def remember(text: str) -> None:
    """Make `hide` hide the passwords of *text*, but those too short to hide anywhere."""
    passwords = tuple(p for p in secrets_of(text).passwords if len(p) >= _MIN_FRAGMENT)
    with _REMEMBERING:
        _REMEMBERED.pop(text, None)
        _REMEMBERED[text] = passwords  # the newest last: the first is the next to go
        while len(_REMEMBERED) > _REMEMBERED_URIS:
            del _REMEMBERED[next(iter(_REMEMBERED))]


def hide(text: str) -> str:
    """Replace each password of a URI this process parsed of late (`remember`) with ``***``."""
    with _REMEMBERING:
        remembered = {secret for passwords in _REMEMBERED.values() for secret in passwords}
    remembered |= {repr(secret)[1:-1] for secret in remembered}  # as a message's {value!r}
    for secret in sorted(remembered, key=lambda secret: (-len(secret), secret)):
        text = text.replace(secret, HIDDEN)
    return text


def _scheme_of(text: str) -> str:
    match = _known_scheme(text)
    return "" if match is None else match[0][:-1].lower()


def _longest_first(pieces: set[str]) -> tuple[str, ...]:
    return tuple(sorted((piece for piece in pieces if piece), key=lambda p: (-len(p), p)))


def scrub(text: str, secrets: Secrets) -> str:
    """Hide what *text* (a driver's or a server's words) shows of *secrets*.

    Each secret where it shows whole (a short name only quoted alone: ``user 'ci'``), then
    any run of four characters of one: a driver may quote a piece, a server cut a name.
    Last, whatever follows a secret option or a URI's user information in *text* itself: a
    driver may quote a conninfo it decoded.
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
    found = _Found(text)
    for view, where in _views(text):
        _find_in_view(text, view, where, found, own=False)
    return _hidden(text, _merged(found.spans))
