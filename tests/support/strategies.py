"""What the hostile suite generates: passwords that parsers split, URIs, records from anyone.

A generated password is runs of letters no message of lockrun's contains (so a run found
in the output can only be a leak), joined by the characters URI parsers split at. Any run
of four or more of its letters, as written or percent-encoded, is a fragment that must
never be printed.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import TYPE_CHECKING, Final

from hypothesis import strategies as st

if TYPE_CHECKING:
    from collections.abc import Iterable

# What parsers split a URI at, or what a terminal or a line would act on.
SPLITTERS: Final = ":/?#@&=%+;[]{}\\\"' \t\n\r\x1b*~!$,|<>^`."
# Letters that appear in no message of lockrun's: a run of them in its output leaked.
RARE: Final = "QXZJKWVŊÆØßЖЯ漢字"
_RUN: Final = re.compile(f"[{re.escape(RARE)}]{{4,}}")

plain_passwords = st.text(alphabet=RARE, min_size=4, max_size=24)
_gaps = st.text(alphabet=SPLITTERS, max_size=3)
# At least one run to look for, with what parsers split at around it and anywhere else.
passwords = st.builds(
    "".join,
    st.tuples(
        _gaps,
        st.text(alphabet=RARE, min_size=4, max_size=8),
        _gaps,
        st.text(alphabet=RARE + SPLITTERS, max_size=16),
    ),
)

# Where a secret goes: {secret} raw, or %-encoded as {quoted}; {port} a port nobody uses.
USERINFO_TEMPLATES: Final = (
    "redis://:{secret}@127.0.0.1:{port}/0",
    "redis://{secret}@127.0.0.1:{port}/0",  # the password-only form
    "redis://user:{secret}@127.0.0.1:{port}/0",
    "rediss://:{secret}@127.0.0.1:{port}/0",
    "redis+sentinel://:{secret}@127.0.0.1:{port}/mymaster",
    "redis+cluster://:{secret}@127.0.0.1:{port},127.0.0.2:{port}",
    "rediss+cluster://user:{secret}@[::1]:{port},127.0.0.1",
    "mysql://user:{secret}@127.0.0.1:{port}/db",
    "mariadb://{secret}@127.0.0.1:{port}/db",
    "postgresql://user:{secret}@127.0.0.1:{port}/db",
    "postgres://{secret}:{secret}@127.0.0.1:{port}/db",
    "etcd://user:{secret}@127.0.0.1:{port}",
    "etcds://{secret}:{secret}@127.0.0.1:{port},[::1]:{port}",
)
OPTION_TEMPLATES: Final = (
    "unix:///nonexistent/redis.sock?password={secret}",
    "redis+sentinel://127.0.0.1:{port}/mymaster?sentinel_password={secret}",
    "postgresql://127.0.0.1:{port}/db?password={secret}",
    "postgresql://127.0.0.1:{port}/db?sslmode=disable&sslpassword={secret}&connect_timeout=2",
    "postgres:///db?host=/nonexistent&password={secret}",
)
TEMPLATES: Final = USERINFO_TEMPLATES + OPTION_TEMPLATES

# The ten schemes of the server backends, each with a host that answers nothing at once.
SERVER_SCHEMES: Final = {
    "redis": "127.0.0.1:{port}/0",
    "rediss": "127.0.0.1:{port}/0",
    "unix": "/nonexistent/redis.sock",
    "redis+sentinel": "127.0.0.1:{port}/mymaster",
    "redis+cluster": "127.0.0.1:{port},127.0.0.2:{port}",
    "rediss+cluster": "127.0.0.1:{port}",
    "mysql": "127.0.0.1:{port}/db",
    "mariadb": "127.0.0.1:{port}/db",
    "postgresql": "127.0.0.1:{port}/db",
    "postgres": "127.0.0.1:{port}/db",
    "etcd": "127.0.0.1:{port}",
    "etcds": "127.0.0.1:{port},127.0.0.2:{port}",
}


def _encoded(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def libpq_quoted(secret: str) -> str:
    r"""Return *secret* as a libpq conninfo value: in quotes, with \ and \' escaped."""
    return "'" + secret.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _spellings(scheme: str, where: str) -> dict[str, str]:
    """Return the ways to write a secret for *scheme* ({s} raw, {e} %-encoded: see `spell`)."""
    at = f"{scheme}://{where}"
    query = f"{at}{'&' if '?' in at else '?'}"
    return {
        "user:password@": f"{scheme}://u:{{e}}@{where}",
        "user:password, no @host": f"{scheme}://u:{{e}}",
        ":password, no @host": f"{scheme}://:{{e}}",
        "user:password, no //": f"{scheme}:u:{{e}}",
        "user:password, no //, then @host": f"{scheme}:u:{{e}}@{where}",
        "raw user:password, no @host": f"{scheme}://u:{{r}}",
        "?password=": f"{query}password={{e}}",
        "raw ?password=": f"{query}password={{s}}",
        "?PASSWORD=": f"{query}x=1&PASSWORD={{e}}",
        "%-encoded name": f"{query}p%61ssword={{e}}",
        "all %-encoded name": f"{query}%70%61%73%73%77%6F%72%64={{e}}",
        "?pwd=": f"{query}pwd={{e}}",
        "?passwd=": f"{query}passwd={{e}}",
        "?auth=": f"{query}auth={{e}}",
        "?token=": f"{query}token={{e}}",
        "?client_secret=": f"{query}client_secret={{e}}",
        "?sslpassword=": f"{query}sslmode=disable&sslpassword={{e}}&connect_timeout=2",
        "?sentinel_password=": f"{query}sentinel_password={{e}}",
        "nested conninfo in ?dbname=": f"{query}dbname={{nested_kv}}",
        "nested conninfo in ?options=": f"{query}options={{nested_options}}",
        "nested URI in ?dbname=": f"{query}dbname={{nested_uri}}",
        "raw nested URI in ?dbname=": f"{query}dbname=postgresql://u:{{e}}@h/db",
        "twice-encoded nested conninfo": f"{query}dbname={{twice}}",
        # Options whose values lockrun's own messages quote (a file, a charset).
        "nested conninfo in ?charset=": f"{query}charset={{nested_kv}}",
        "nested conninfo in ?ssl_ca=": f"{query}ssl_ca={{nested_kv}}",
        "nested conninfo in ?ssl_ca_certs=": f"{query}ssl_ca_certs={{nested_kv}}",
        "nested conninfo in ?read_default_file=": f"{query}read_default_file={{nested_kv}}",
        "%-encoded = and &": f"{query}x=1%26password%3D{{e}}",
    }


def spellings(port: int = 1) -> dict[str, str]:
    """Return every spelling of a secret lockrun must hide, by name, as `spell` fills them."""
    found = {}
    for scheme, where in SERVER_SCHEMES.items():
        for name, template in _spellings(scheme, where.replace("{port}", str(port))).items():
            found[f"{scheme}: {name}"] = template
    for scheme in ("redis", "rediss", "mysql", "mariadb", "postgresql"):  # a database's name
        found[f"{scheme}: nested conninfo in the path"] = (
            f"{scheme}://127.0.0.1:{port}/{{nested_kv}}"
        )
    kv = f"host=127.0.0.1 port={port} dbname=db"
    found |= {
        "conninfo": f"{kv} password={{q}} connect_timeout=2",
        "conninfo, spaces around =": f"host=127.0.0.1 port={port} password = {{q}}",
        "conninfo, bare value": f"password={{b}} {kv}",
        "conninfo after postgresql://": f"postgresql://{kv} password={{q}}",
        "conninfo in a quoted dbname": f"host=127.0.0.1 port={port} dbname='x password={{qq}}'",
        "conninfo, sslpassword": f"{kv} sslpassword={{q}}",
    }
    return found


def spell(template: str, secret: str) -> str:
    """Return *template* (of `spellings`) with *secret* written as each placeholder says."""
    quoted = libpq_quoted(secret)
    pieces = {
        "s": secret,
        # Raw but for @, which would make what follows it the host, as in any URI.
        "r": secret.replace("@", "%40"),
        "e": _encoded(secret),
        "q": quoted,
        # A bare libpq value ends at white space: only where the secret has none.
        "b": _encoded(secret) if re.search(r"[\s'\\]", secret) or not secret else secret,
        "qq": quoted.replace("\\", "\\\\").replace("'", "\\'"),
        "nested_kv": _encoded(f"x password={quoted}"),
        "nested_options": _encoded(f"-c password={quoted}"),
        "nested_uri": _encoded(f"postgresql://u:{_encoded(secret)}@h/db"),
        "twice": _encoded(_encoded(f"x password={quoted}")),
    }
    return re.sub(r"\{(\w+)\}", lambda match: pieces[match[1]], template)


def place(template: str, secret: str, *, encoded: bool, port: int = 1) -> str:
    """Return *template* with *secret* in it, raw or percent-encoded."""
    written = urllib.parse.quote(secret, safe="") if encoded else secret
    return template.replace("{secret}", written).replace("{port}", str(port))


def fragments(secret: str) -> set[str]:
    """Return what of *secret* must never show: its runs of rare letters, raw and encoded."""
    runs = set(_RUN.findall(secret))
    encoded = {_encoded(run) for run in runs}
    return runs | encoded | {_encoded(run) for run in encoded}  # and encoded twice


def assert_hidden(secret: str, *outputs: str) -> None:
    """Assert that no fragment of *secret* is in any of *outputs*."""
    for output in outputs:
        shown = [piece for piece in fragments(secret) if piece in output]
        assert not shown, f"{shown} of the password is in: {output!r}"


# -- records from anyone ------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def holder_like(values: st.SearchStrategy[object] = json_values) -> st.SearchStrategy[object]:
    """Return dicts with a holder's keys, each set to anything: near misses of a record."""
    keys = (
        *("host", "pid", "user", "argv", "since", "slot", "expires", "name", "namespace"),
        *("shared", "until"),
    )
    return st.fixed_dictionaries(
        {},
        optional={
            **dict.fromkeys(keys, values),
            "slots": values | st.integers(min_value=-5, max_value=2**70),
            "token": values,
            "holder": values | st.fixed_dictionaries({}, optional=dict.fromkeys(keys, values)),
        },
    )


def deep(depth: int) -> str:
    """Return JSON nested *depth* deep (a decoder that recurses runs out of stack)."""
    return "[" * depth + "]" * depth


def lines(*outputs: str) -> Iterable[str]:
    """Yield every line of *outputs*."""
    for output in outputs:
        yield from output.splitlines()
