"""What each scheme offers (`Scheme.modes`, `Scheme.detachable`), and the one place that refuses.

In-process: `lockrun.bounds.check_modes` is what a run, ``lockrun acquire`` (with or without a
keeper) and the Python API call before anything is opened (docs/semantics.md "Fleet modes").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, get_args

import pytest

from lockrun import AsyncLock, ExitCode, Lock, UsageError
from lockrun import bounds as bounds_module
from lockrun.backends import Connect, parse_uri
from lockrun.backends import abstract as abstract_backend
from lockrun.backends import file as file_backend
from lockrun.bounds import check_modes, check_offered
from lockrun.uri import MODES, SCHEMES, Mode, Scheme

if TYPE_CHECKING:
    from collections.abc import Mapping

# What each backend offers: the product decision of issue 31 (abstract: has no storage).
OFFERED: dict[str, frozenset[Mode]] = {
    "file": MODES,
    "abstract": frozenset({"shared"}),
    "redis": MODES,
    "mysql": MODES,
    "postgres": MODES,
    "etcd": MODES,  # each built on etcd's own primitives (docs/design.md A13)
}
# mypy checks each local backend's factory against the `Connect` protocol here.
LOCAL_FACTORIES: tuple[Connect, ...] = (file_backend.connect, abstract_backend.connect)
CASES = [(scheme, mode) for scheme in SCHEMES for mode in get_args(Mode)]


def asked(mode: Mode) -> Mapping[str, object]:
    """Return `check_modes`'s keywords that ask for *mode* alone."""
    return {
        "shared": mode == "shared",
        "hold": 3600.0 if mode == "hold-at-least" else 0,
        "take_over": mode == "take-over",
    }


def test_every_backend_says_what_it_offers() -> None:
    """The registry's rows agree with the documented table, backend by backend."""
    assert {scheme.backend for scheme in SCHEMES.values()} == set(OFFERED)
    for name, scheme in SCHEMES.items():
        assert scheme.modes == OFFERED[scheme.backend], name


def test_only_redis_and_etcd_can_hold_a_lock_with_no_process() -> None:
    """--no-keeper needs a lease the server keeps: the Redis and etcd schemes, and no other."""
    detachable = {name for name, scheme in SCHEMES.items() if scheme.detachable}
    kept = {"redis", "etcd"}
    assert detachable == {name for name, scheme in SCHEMES.items() if scheme.backend in kept}
    assert all(SCHEMES[name].leased for name in detachable)


def test_only_a_lease_no_connection_holds_has_its_guardian_forked_late() -> None:
    """A guardian forked after the run connected drops the connections it inherited.

    Right where a lease is the lock (etcd); where a session is (MySQL, PostgreSQL), the
    guardian must never have held the waiter's connection (docs/design.md A11).
    """
    late = {name for name, scheme in SCHEMES.items() if scheme.tells_waiting}
    assert late == {"etcd", "etcds"}
    assert all(SCHEMES[name].leased and not SCHEMES[name].session for name in late)


def test_a_scheme_offers_no_mode_unless_it_says_so() -> None:
    """A new backend's row starts with no modes and no --no-keeper."""
    row = Scheme("etcd", "etcd://HOST", {"etcd://": "etcd"}, leased=True)
    assert (row.modes, row.detachable) == (frozenset(), False)


@pytest.mark.parametrize(("scheme", "mode"), CASES)
def test_the_command_line_gets_each_mode_or_one_line(scheme: str, mode: Mode) -> None:
    """Each scheme × mode: accepted where offered, else a usage error (64) in one line."""
    if mode in SCHEMES[scheme].modes:
        seconds = check_modes(1, cli=True, scheme=scheme, **asked(mode))  # type: ignore[arg-type]
        assert seconds == (3600.0 if mode == "hold-at-least" else 0.0)
        return
    with pytest.raises(UsageError) as refused:
        check_modes(1, cli=True, scheme=scheme, **asked(mode))  # type: ignore[arg-type]
    assert refused.value.exit_code == ExitCode.USAGE
    offered = "(only --shared is)" if SCHEMES[scheme].modes else "(no mode is)"
    assert str(refused.value) == f"--{mode} is not supported by {scheme}: {offered}"


@pytest.mark.parametrize(("scheme", "mode"), CASES)
def test_the_api_gets_each_mode_or_usage_error(scheme: str, mode: Mode) -> None:
    """The Python API's spelling: hold_at_least, take_over; the same refusals."""
    if mode in SCHEMES[scheme].modes:
        check_modes(1, scheme=scheme, **asked(mode))  # type: ignore[arg-type]
        return
    offered = r"\(only shared is\)" if SCHEMES[scheme].modes else r"\(no mode is\)"
    with pytest.raises(UsageError, match=rf"^\w+ is not supported by \w+: {offered}$"):
        check_modes(1, scheme=scheme, **asked(mode))  # type: ignore[arg-type]


def test_a_scheme_is_refused_before_the_slots_are_looked_at() -> None:
    """What the backend declines is said first: a --slots change would not help."""
    with pytest.raises(UsageError, match="--take-over is not supported by abstract:"):
        check_modes(3, shared=False, hold=0, take_over=True, cli=True, scheme="abstract")
    with pytest.raises(UsageError, match="--take-over applies to a lock of one slot"):
        check_modes(3, shared=False, hold=0, take_over=True, cli=True, scheme="file")


def test_values_are_checked_before_what_the_scheme_offers() -> None:
    """A hold that is no number is that, on any scheme: the type comes first."""
    with pytest.raises(UsageError, match="hold_at_least must be a number of seconds"):
        check_modes(1, shared=False, hold="1h", scheme="abstract")
    with pytest.raises(UsageError, match="take_over must be True or False"):
        check_modes(1, shared=False, hold=0, take_over="yes", scheme="abstract")  # type: ignore[arg-type]


def test_no_hold_is_no_mode() -> None:
    """--hold-at-least 0 asks for nothing: abstract: takes it."""
    assert check_modes(1, shared=True, hold=0, cli=True, scheme="abstract") == 0.0


def test_without_a_scheme_only_the_combinations_are_checked() -> None:
    """A token read back (`lockrun renew`) names no scheme: its modes are checked as before."""
    assert check_modes(1, shared=False, hold=5, take_over=True) == 5.0


def test_a_backend_with_no_modes_refuses_each_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new backend can ship with modes=frozenset(): every mode is refused, and says so."""
    row = Scheme("etcd", "etcd://HOST", {"etcd://": "etcd"}, leased=True)
    monkeypatch.setattr(bounds_module, "SCHEMES", {**SCHEMES, "etcd": row})
    for mode in get_args(Mode):
        with pytest.raises(UsageError) as refused:
            check_offered("etcd", [mode])
        assert str(refused.value) == f"--{mode} is not supported by etcd: (no mode is)"
    check_offered("etcd", [])


def test_two_offered_modes_are_listed_with_and(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal names what the backend does offer, in the options' order."""
    row = Scheme("etcd", "etcd://HOST", {}, modes=frozenset({"take-over", "shared"}))
    monkeypatch.setattr(bounds_module, "SCHEMES", {**SCHEMES, "etcd": row})
    with pytest.raises(UsageError) as refused:
        check_offered("etcd", ["hold-at-least"], cli=False)
    assert (
        str(refused.value)
        == "hold_at_least is not supported by etcd: (only shared and take_over are)"
    )


@pytest.mark.parametrize(
    "keywords", [{"hold_at_least": 60}, {"take_over": True, "wait": 5}], ids=["hold", "take-over"]
)
def test_lock_refuses_what_abstract_declines(keywords: dict[str, object]) -> None:
    """`Lock(uri="abstract:", …)` raises UsageError at once; nothing is opened by a Lock yet."""
    with pytest.raises(UsageError, match="is not supported by abstract:"):
        Lock("sales", uri="abstract:", **keywords)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="is not supported by abstract:"):
        AsyncLock("sales", uri="abstract:", **keywords)  # type: ignore[arg-type]
    assert Lock("sales", uri="abstract:", shared=True).shared


def test_the_api_takes_what_a_scheme_offers() -> None:
    """On file: a hold and a take-over are described; nothing is taken before acquire."""
    assert Lock("sales", uri="file:", hold_at_least=60).hold_at_least == 60.0
    assert Lock("sales", uri="file:", take_over=True, wait=5).take_over
    AsyncLock("sales", uri="file:", hold_at_least=60)


def test_the_uri_names_the_row_that_is_checked() -> None:
    """A URI's scheme is the key `check_modes` is given: aliases share their backend's modes."""
    for text in ("redis://h", "rediss://h", "unix:///r.sock", "mariadb://h/db", "postgres://h/db"):
        uri = parse_uri(text)
        assert uri.kind == SCHEMES[uri.scheme]
        check_offered(uri.scheme, sorted(MODES))


def test_every_backend_module_has_its_factory() -> None:
    """Each row's module has the ``connect`` that `open_backend` calls (typed: `Connect`)."""
    for backend in {scheme.backend for scheme in SCHEMES.values()}:
        module = importlib.import_module(f"lockrun.backends.{backend}")
        assert callable(module.connect), backend
    assert all(callable(connect) for connect in LOCAL_FACTORIES)
