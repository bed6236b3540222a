"""Login, sessions and their cookies, throttling, logout, and the credentials file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dgpp.engine.errors import ConfigError
from dgpp.webui.security.credentials import load_credentials, write_credentials
from dgpp.webui.security.login_limiter import LoginLimiter
from dgpp.webui.security.sessions import SESSION_COOKIE, SessionStore
from tests.webui.conftest import PASSWORD, USER, Console, hidden, running_console


def test_pages_redirect_to_the_login_and_api_routes_answer_401(console: Console) -> None:
    for path in ("/", "/models", "/knobs", "/logs", "/switch", "/logs?rank=1"):
        response = console.client.get(path, follow_redirects=False)
        assert response.status_code == 303, path
        assert response.headers["location"].startswith("/login?next=%2F")
    for path in ("/api/overview", "/api/history", "/api/switch", "/api/logs/0"):
        response = console.client.get(path)
        assert response.status_code == 401, path
        assert response.json() == {"error": "login required"}


def test_login_sets_a_strict_httponly_session_cookie(console: Console) -> None:
    page = console.client.get("/login")
    assert 'name="username"' in page.text and 'name="password"' in page.text
    response = console.login()
    assert response.status_code == 303 and response.headers["location"] == "/"
    cookie = next(
        value
        for name, value in response.headers.multi_items()
        if name == "set-cookie" and value.startswith(f"{SESSION_COOKIE}=")
    )
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    overview = console.client.get("/")
    assert overview.status_code == 200 and USER in overview.text
    assert PASSWORD not in overview.text


def test_wrong_password_is_refused_without_saying_which_part_was_wrong(console: Console) -> None:
    wrong_password = console.login(password="nope nope nope")
    wrong_user = console.login(username="root")
    for response in (wrong_password, wrong_user):
        assert response.status_code == 401
        assert "Wrong user name or password." in response.text
    assert console.client.get("/", follow_redirects=False).status_code == 303


def test_login_needs_the_form_token_from_its_cookie(console: Console) -> None:
    console.client.get("/login")
    response = console.client.post(
        "/login",
        data={"username": USER, "password": PASSWORD, "csrf_token": "forged"},
        follow_redirects=False,
    )
    assert response.status_code == 403
    console.client.cookies.clear()
    response = console.client.post(
        "/login", data={"username": USER, "password": PASSWORD}, follow_redirects=False
    )
    assert response.status_code == 403
    assert console.client.get("/", follow_redirects=False).status_code == 303


def test_login_attempts_are_throttled(console: Console) -> None:
    for _ in range(console.config.login_max_failures):
        assert console.login(password="guess guess").status_code == 401
    blocked = console.login()  # even the right password waits now
    assert blocked.status_code == 429
    assert int(blocked.headers["retry-after"]) > 0
    assert "Too many failed attempts" in blocked.text


def test_login_redirects_only_within_the_console(console: Console) -> None:
    for target, expected in (("/knobs", "/knobs"), ("//evil.example", "/"), ("https://x", "/")):
        console.client.cookies.clear()
        page = console.client.get("/login", params={"next": target})
        response = console.client.post(
            "/login",
            data={
                "username": USER,
                "password": PASSWORD,
                "csrf_token": hidden(page.text, "csrf_token"),
                "next": target,
            },
            follow_redirects=False,
        )
        assert response.headers["location"] == expected


def test_logout_ends_the_session(logged_in: Console) -> None:
    token = logged_in.csrf()
    response = logged_in.client.post("/logout", data={"csrf_token": token}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/login"
    assert logged_in.client.get("/api/overview").status_code == 401


def test_pages_carry_a_strict_content_security_policy(logged_in: Console) -> None:
    response = logged_in.client.get("/")
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["cache-control"] == "no-store"
    assert "<script>" not in response.text  # no inline script: the policy forbids it


def test_credentials_file_is_mode_0600_and_holds_only_a_hash(tmp_path: Path) -> None:
    path = tmp_path / "etc" / "webui.credentials"
    write_credentials(path, "admin", "a long password")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "a long password" not in text and "DGPP_WEBUI_PASSWORD_HASH=scrypt$" in text
    credentials = load_credentials(path)
    assert credentials.verify("admin", "a long password")
    assert not credentials.verify("admin", "a long passwor")
    assert "scrypt" not in repr(credentials)
    with pytest.raises(ConfigError, match="at least 8"):
        write_credentials(path, "admin", "short")


def test_a_plain_text_password_file_from_an_installer_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "webui.credentials"
    path.write_text("DGPP_WEBUI_USER=admin\nDGPP_WEBUI_PASSWORD=Xy7generated\n")
    path.chmod(0o600)
    assert load_credentials(path).verify("admin", "Xy7generated")
    with pytest.raises(ConfigError, match="set-password"):
        load_credentials(tmp_path / "missing")


def test_new_password_hashes_use_owasp_scrypt_strength_and_old_ones_still_verify() -> None:
    from dgpp.webui.security.credentials import hash_password, verify_password

    scheme, n, r, p, _, _ = hash_password("a long password").split("$")
    assert (scheme, int(n) >= 2**17, int(r), int(p)) == ("scrypt", True, 8, 1)
    old = "scrypt$16384$8$1$c2FsdHNhbHRzYWx0c2FsdA==$"  # made before: N=2^14
    import base64
    import hashlib

    salt = base64.b64decode("c2FsdHNhbHRzYWx0c2FsdA==")
    digest = hashlib.scrypt(b"a long password", salt=salt, n=2**14, r=8, p=1)
    assert verify_password("a long password", old + base64.b64encode(digest).decode())


def test_sessions_expire() -> None:
    now = [1000.0]
    store = SessionStore(ttl_s=60, clock=lambda: now[0])
    token, session = store.create("admin", "t1")
    assert store.get(token, "t1") == session
    now[0] += 61
    assert store.get(token, "t1") is None


def test_set_password_ends_every_session(tmp_path: Path) -> None:
    """`dgpp webui set-password` replaces the credentials file; sessions opened before are void
    at their next request, in the running console, without a restart."""
    with running_console(tmp_path) as running:
        assert running.login().status_code == 303
        assert running.client.get("/api/overview").status_code == 200
        write_credentials(running.config.credentials, USER, "a new long password")
        assert running.client.get("/api/overview").status_code == 401
        assert running.login().status_code == 401  # the old password is gone too
        assert running.login(password="a new long password").status_code == 303
        assert running.client.get("/api/overview").status_code == 200


def test_a_session_is_only_valid_under_the_credentials_it_was_opened_with() -> None:
    store = SessionStore(ttl_s=60)
    token, _ = store.create("admin", "t1")
    assert store.get(token, "t2") is None
    assert store.get(token, "t1") is None  # deleted, not just hidden


def test_a_logged_in_browser_stays_logged_in_across_a_console_restart(tmp_path: Path) -> None:
    with running_console(tmp_path) as first:
        assert first.login().status_code == 303
        cookie = first.client.cookies.get(SESSION_COOKIE)
        csrf = first.csrf()
    assert cookie
    with running_console(tmp_path) as second:  # a new process on the same state directory
        second.client.cookies.set(SESSION_COOKIE, cookie)
        assert second.client.get("/api/overview").status_code == 200
        assert second.csrf() == csrf  # its forms' token too
        second.client.post("/logout", data={"csrf_token": csrf})
    with running_console(tmp_path) as third:
        third.client.cookies.set(SESSION_COOKIE, cookie)
        assert third.client.get("/api/overview").status_code == 401  # logged out for good


def test_sessions_survive_a_console_restart_in_a_private_file(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sessions.sqlite"
    now = [1000.0]
    first = SessionStore(ttl_s=60, clock=lambda: now[0], path=path)
    token, session = first.create("admin", "t1")
    expiring, _ = first.create("admin", "t1")
    gone, _ = first.create("admin", "t1")
    first.delete(gone)
    first.close()
    assert path.stat().st_mode & 0o777 == 0o600
    assert token not in path.read_bytes().decode("latin-1")  # only its digest is stored
    second = SessionStore(ttl_s=60, clock=lambda: now[0], path=path)  # the restarted console
    assert second.get(token, "t1") == session
    assert second.get(gone, "t1") is None
    now[0] += 61
    assert second.get(expiring, "t1") is None
    second.close()


def test_an_unreadable_sessions_file_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    store = SessionStore(ttl_s=60, path=path)
    token, session = store.create("admin", "t1")
    assert store.get(token, "t1") == session
    assert (tmp_path / "sessions.sqlite.corrupt").read_bytes().startswith(b"not a database")
    store.close()


def test_the_limiter_waits_longer_after_each_failure_and_forgets_old_ones() -> None:
    now = [0.0]
    limiter = LoginLimiter(max_failures=2, window_s=100, clock=lambda: now[0], base_delay_s=2)
    limiter.failed("a")
    assert limiter.retry_after("a") == 0  # the first failures are free
    limiter.failed("a")
    assert limiter.retry_after("a") == pytest.approx(2)
    assert limiter.retry_after("b") == 0  # another address is never held up
    waits = []
    for _ in range(4):
        now[0] += 1
        limiter.failed("a")
        waits.append(limiter.retry_after("a"))
    assert waits == pytest.approx([4, 8, 16, 32])
    now[0] = 200.0  # every failure has left the window: forgotten, and pruned
    assert limiter.retry_after("a") == 0 and len(limiter) == 0


def test_the_limiter_tracks_a_bounded_number_of_addresses() -> None:
    limiter = LoginLimiter(max_failures=1, window_s=100, max_addresses=3)
    for address in ("a", "b", "c", "d"):
        limiter.failed(address)
    assert len(limiter) == 3 and limiter.retry_after("a") == 0  # the oldest went first
    assert limiter.retry_after("d") > 0


def test_a_strangers_failures_never_lock_the_admin_out(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    with running_console(tmp_path) as running:
        stranger = TestClient(
            running.app, base_url="http://127.0.0.1", client=("203.0.113.9", 40000)
        )
        intruder = Console(stranger, running.world, running.config, running.app)
        for _ in range(running.config.login_max_failures + 3):
            intruder.login(password="guess guess")
        assert intruder.login().status_code == 429  # the stranger waits, even with the password
        assert running.login().status_code == 303  # the admin, from elsewhere, does not
