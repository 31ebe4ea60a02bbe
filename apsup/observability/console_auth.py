"""Who may see and act from the console: loopback readers, and operators holding the token.

- **Without a credential** (no ``CONSOLE_TOKEN_FILE`` / ``CONSOLE_TOKEN``) the console is
  read-only and answers only clients on loopback (an SSH tunnel, ``kubectl port-forward``); a
  client from elsewhere gets 403 and one line saying what to set. ``/healthz``, ``/readyz``,
  ``/metrics`` and ``/status`` are not the console: probes and scrapers reach them as before
  (a container binds beyond loopback for them).
- **With a credential**, ``login`` (a POST of the token, compared in constant time) opens a
  session: a random id in an ``HttpOnly``, ``SameSite=Strict`` cookie, and a per-session CSRF
  token that every action form carries back. Loopback readers still need no login to read;
  every action needs a session. ``Authorization: Bearer <token>`` also reads ``/cluster``.

Sessions live in this process's memory (a restart logs everyone out) and last
``SESSION_SECONDS``. The token is never logged or shown.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.cookies import SimpleCookie

COOKIE = "apsup_console"
#: Seconds a console session lasts.
SESSION_SECONDS = 8 * 3600.0
#: Sessions kept at most (the oldest is dropped first).
MAX_SESSIONS = 256


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@dataclass
class Session:
    sid: str
    csrf: str
    who: str  # for the action log: how and from where the session was opened
    created: float
    flash: list[str] = field(default_factory=list)


class ConsoleAuth:
    def __init__(self, token: str | None) -> None:
        self._token = token
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether actions can be unlocked at all (a credential is configured)."""
        return bool(self._token)

    def token_matches(self, offered: str) -> bool:
        token = self._token
        return bool(token) and hmac.compare_digest(offered.encode(), str(token).encode())

    def bearer(self, header: str | None) -> bool:
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and self.token_matches(value.strip())

    def login(self, offered: str, client: str) -> Session | None:
        if not self.token_matches(offered):
            return None
        now = time.monotonic()
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(24), client, now)
        session.who = f"console session from {client}"
        with self._lock:
            self._expire(now)
            while len(self._sessions) >= MAX_SESSIONS:
                del self._sessions[next(iter(self._sessions))]
            self._sessions[session.sid] = session
        return session

    def logout(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.sid, None)

    def session(self, cookie_header: str | None) -> Session | None:
        if not cookie_header or not self.enabled:
            return None
        try:
            morsel = SimpleCookie(cookie_header).get(COOKIE)
        except Exception:  # a malformed Cookie header is no session
            return None
        if morsel is None:
            return None
        with self._lock:
            self._expire(time.monotonic())
            return self._sessions.get(morsel.value)

    def _expire(self, now: float) -> None:
        for sid in [s for s, v in self._sessions.items() if now - v.created > SESSION_SECONDS]:
            del self._sessions[sid]

    @staticmethod
    def csrf_ok(session: Session, offered: str) -> bool:
        return hmac.compare_digest(offered.encode(), session.csrf.encode())

    @staticmethod
    def cookie(session: Session | None) -> str:
        """The ``Set-Cookie`` value that opens (or, for None, ends) a session."""
        if session is None:
            return f"{COOKIE}=; HttpOnly; SameSite=Strict; Max-Age=0"
        return f"{COOKIE}={session.sid}; HttpOnly; SameSite=Strict; Max-Age={int(SESSION_SECONDS)}"
