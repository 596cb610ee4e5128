"""Checks of what guards the daemon: bearer keys and their tenants, the operator's key,
loopback versus reachable addresses, the Redis password sources, TLS files and URL. Every
reason names the key and never quotes a secret. See docs/architecture.md §10.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlparse

from hicache.config.schema import (
    TENANT_NAME_RE,
    ApiKeyConfig,
    ConfigProblem,
    OperatorKeyConfig,
    RedisStoreConfig,
    ServerConfig,
)
from storage_backends.settings import load_secret_env, load_secret_file


def key_text_problem(key: str) -> str | None:
    """None if ``key`` can be a bearer key (non-empty printable ASCII, no spaces), else the
    reason, which never quotes the key."""
    if not key:
        return "must not be empty"
    if not all("!" <= ch <= "~" for ch in key):
        return "must be printable ASCII without spaces or control characters (a bearer token)"
    return None


def has_keys(server: ServerConfig) -> bool:
    """Whether any bearer key is configured (then every route but ``/health`` needs one)."""
    return server.api_key is not None or bool(server.api_keys) or server.operator is not None


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address to bind or connect, or a name) is this host's loopback:
    ``localhost``, ``127.0.0.0/8`` or ``::1``. A wildcard (``0.0.0.0``, ``::``, ``*``) or
    any other name is not."""
    import ipaddress

    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def events_endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (``*`` for a wildcard), None for the
    ``ipc://`` and ``inproc://`` ones (which stay on this host)."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, _, _port = rest.rpartition(":")
    return host or rest


def _key_source_problems(where: str, entry: ApiKeyConfig | OperatorKeyConfig) -> list[tuple[str, str]]:
    """A key entry's source: exactly one of ``key``, ``key_file``, ``key_env``, none empty,
    an inline key a bearer token (reasons never quote it)."""
    out: list[tuple[str, str]] = []
    given = [name for name in ("key", "key_file", "key_env") if getattr(entry, name) is not None]
    if len(given) != 1:
        out.append((where, f"give exactly one of key, key_file, key_env; got {' and '.join(given) or 'none'}"))
    for name in ("key_file", "key_env"):
        value = getattr(entry, name)
        if value is not None and not value.strip():
            out.append((f"{where}.{name}", "must not be empty"))
    if entry.key is not None:
        problem = key_text_problem(entry.key)
        if problem:
            out.append((f"{where}.key", problem))
    return out


def api_key_problems(server: ServerConfig) -> list[tuple[str, str]]:
    """Problems of ``server.api_key`` / ``server.api_keys`` / ``server.operator`` that need no
    file or variable, as ``(key below server, reason)``: an empty ``api_key``; both set; the
    operator's key beside ``api_key``, or equal to a tenant's inline key; an entry without a valid
    tenant name, with not exactly one of ``key`` / ``key_file`` / ``key_env``, with an empty
    one, or whose inline key is not a bearer token; two tenant names that differ only in
    case; an inline key given twice. What the files and variables hold is checked when the
    keys are loaded (``load_api_keys``, below). Reasons never include a key."""
    out: list[tuple[str, str]] = []
    if server.api_key == "":
        out.append(("api_key", "must not be empty (null = no key)"))
    if server.api_key is not None and server.api_keys:
        out.append(("api_keys", "set server.api_key (one key, no tenant) or server.api_keys (keys with tenants), "
                                "not both"))
    op = server.operator
    if op is not None:
        if server.api_key is not None:
            out.append(("operator", "server.api_key is already the operator's key (a daemon without tenants): give "
                                    "tenants keys in server.api_keys beside server.operator, or drop one"))
        out.extend(_key_source_problems("operator", op))
        if op.key is not None and not key_text_problem(op.key):
            if any(entry.key == op.key for entry in server.api_keys):
                out.append(("operator.key", "is also a tenant's key in server.api_keys: the operator's key must be "
                                            "its own"))
    spelled: dict[str, tuple[str, int]] = {}
    inline: dict[str, int] = {}
    for i, entry in enumerate(server.api_keys):
        where = f"api_keys[{i}]"
        if entry == ApiKeyConfig():  # ``{}``, or not a mapping at all (reported at this path already)
            out.append((where, "must give a tenant and one of key, key_file, key_env"))
            continue
        if not entry.tenant:
            out.append((f"{where}.tenant", "is required (the tenant this key authenticates)"))
        elif not re.fullmatch(TENANT_NAME_RE, entry.tenant):
            out.append((f"{where}.tenant", "must be 1 to 64 ASCII letters, digits, '.', '_' or '-', starting with "
                                           f"a letter or digit; got {entry.tenant!r}"))
        else:
            first, j = spelled.setdefault(entry.tenant.lower(), (entry.tenant, i))
            if first != entry.tenant:
                out.append((f"{where}.tenant", f"{entry.tenant!r} differs only in case from {first!r} "
                                               f"(api_keys[{j}]): spell a tenant the same in every entry"))
        out.extend(_key_source_problems(where, entry))
        if entry.key is not None and not key_text_problem(entry.key):
            if entry.key in inline:
                out.append((f"{where}.key", f"is the same key as api_keys[{inline[entry.key]}].key: "
                                            "each key must be given once"))
            else:
                inline[entry.key] = i
    quota_of: dict[str, int] = {}
    for i, entry in enumerate(server.api_keys):
        if entry.quota is None or not entry.tenant:
            continue
        where = f"api_keys[{i}].quota"
        if entry.tenant in quota_of:
            out.append((where, f"tenant {entry.tenant!r} has a quota already (api_keys[{quota_of[entry.tenant]}]): "
                               "give it on one entry"))
        quota_of.setdefault(entry.tenant, i)
    return out


def redis_secret_problems(r: RedisStoreConfig, check_files: bool) -> list[tuple[str, str]]:
    """Problems of ``cache.l3.redis``'s password and TLS keys, as ``(key, reason)``.

    Always: more than one password source (``password``, ``password_file``,
    ``password_env``, a password in ``url``), an empty value, a ``tls_*`` file without a
    ``rediss://`` URL, ``tls_key_file`` without ``tls_cert_file``. With ``check_files`` (the
    store is in use): a password file that cannot be read or holds no password, an unset or
    empty ``password_env`` variable, TLS files that cannot be read or loaded (the same
    checks the backend makes when it attaches). Reasons never include a secret.
    """
    out: list[tuple[str, str]] = []
    try:
        parsed = urlparse(r.url)
        url_password = parsed.password or next(iter(parse_qs(parsed.query).get("password", [])), None)
        scheme = parsed.scheme
    except ValueError:  # redis_url_problem reports it
        url_password, scheme = None, ""
    if r.password == "":
        out.append(("password", "must not be empty (null = no password)"))
    for key in ("password_file", "password_env", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        value = getattr(r, key)
        if value is not None and not value.strip():
            out.append((key, "must not be empty (null = unset)"))
    named = [("password", r.password), ("password_file", r.password_file), ("password_env", r.password_env),
             ("url", url_password)]
    sources = [key for key, value in named if value]
    if len(sources) > 1:
        out.append((sources[-1], "give the Redis password in one place only (password, password_file, password_env "
                                 f"or the url's user:password@); got {' and '.join(sources)}"))
    tls_keys = [k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(r, k)]
    if tls_keys and scheme in ("redis", "unix"):
        for key in tls_keys:
            out.append((key, f"needs a rediss:// url (TLS); url is {scheme}://"))
    if r.tls_key_file and not r.tls_cert_file:
        out.append(("tls_key_file", "needs tls_cert_file (the client certificate this key belongs to)"))
    if not check_files or out:
        return out
    from storage_backends.settings import load_password_env, load_password_file, tls_file_problems

    try:
        if r.password_file:
            load_password_file(r.password_file)
        elif r.password_env:
            load_password_env(r.password_env)
    except ValueError as exc:
        out.append(("password_file" if r.password_file else "password_env", str(exc)))
    if scheme == "rediss":
        out.extend(tls_file_problems(r.tls_ca_file, r.tls_cert_file, r.tls_key_file))
    return out


def redis_url_problem(url: str) -> str | None:
    """None if ``url`` is a usable redis://, rediss:// or unix:// URL, else the reason (which
    quotes the URL with its password as ``***``)."""
    from storage_backends.settings import redact_url

    shown = redact_url(url)
    try:
        parsed = urlparse(url)
    except ValueError as exc:
        return f"does not parse: {exc}"
    if parsed.scheme not in ("redis", "rediss", "unix"):
        return f"scheme must be redis, rediss or unix; got {shown!r}"
    if parsed.scheme == "unix":
        return None if parsed.path else f"unix URL needs a socket path; got {shown!r}"
    if not parsed.hostname:
        return f"needs a host; got {shown!r}"
    try:
        parsed.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        return f"has an invalid port; got {shown!r}"
    db = parsed.path.lstrip("/")
    if db and not db.isdigit():
        return f"database must be a number; got {db!r}"
    return None


@dataclass(frozen=True)
class BearerKey:
    """One loaded API key: the ``tenant`` it authenticates, or None for the operator's key
    (``server.operator``, or ``server.api_key`` of a daemon without tenants), and the SHA-256
    ``digest`` of the key. The key itself is not kept."""

    tenant: str | None
    digest: bytes = field(repr=False)


def load_api_keys(server: ServerConfig) -> tuple[tuple[BearerKey, ...], list[ConfigProblem]]:
    """The bearer keys of ``server`` (``api_key``, every ``api_keys`` entry, ``operator``),
    with the problems that stop the daemon from using them; the keys are only meaningful
    when the problems are empty.

    ``server`` passed ``load_config`` (``hicache.config.api_key_problems``). Reads each
    ``key_file`` (UTF-8 text, one trailing ``\\n`` or ``\\r\\n`` dropped) and each ``key_env``
    variable now. Problems: a file that cannot be read, is not UTF-8, is empty or holds more
    than one line; an unset or empty variable; a key that is not printable ASCII without
    spaces; a key given twice (in any two entries, the operator's included). Reasons name
    the entry, file or variable, never a key."""
    if server.api_key is not None:
        return (BearerKey(None, _digest(server.api_key)),), []
    keys: list[BearerKey] = []
    problems: list[ConfigProblem] = []
    seen: dict[bytes, str] = {}
    sources: list[tuple[str, str | None, str | None, str | None, str | None]] = [
        (f"server.api_keys[{i}]", e.tenant, e.key, e.key_file, e.key_env) for i, e in enumerate(server.api_keys)]
    if server.operator is not None:
        op = server.operator
        sources.append(("server.operator", None, op.key, op.key_file, op.key_env))
    for where, tenant, inline, key_file, key_env in sources:
        try:
            if key_file is not None:
                where += ".key_file"
                key = load_secret_file(key_file, "key")
            elif key_env is not None:
                where += ".key_env"
                key = load_secret_env(key_env)
            else:
                where += ".key"
                key = inline or ""
        except ValueError as exc:
            problems.append(ConfigProblem(where, str(exc)))
            continue
        problem = key_text_problem(key)
        if problem:
            problems.append(ConfigProblem(where, problem if where.endswith(".key") else f"the key it holds {problem}"))
            continue
        digest = _digest(key)
        if digest in seen:
            problems.append(ConfigProblem(where, f"gives the same key as {seen[digest]}: each key must be given once"))
            continue
        seen[digest] = where.rsplit(".", 1)[0]
        keys.append(BearerKey(tenant, digest))
    return tuple(keys), problems


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
