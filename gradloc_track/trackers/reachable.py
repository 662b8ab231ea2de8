"""Is anything listening at a tracking server's address? Asked once, before the SDK's first request.
(And can a SQLite store's file be written: ``check_sqlite``.)

MLflow's client retries a refused connection with backoff for about two minutes (its default
``MLFLOW_HTTP_REQUEST_MAX_RETRIES``), so a server that is not running cost the run its whole
``tracker.open_timeout_s`` before it was called down, and the warning said only "no answer within
120 s". One TCP connect tells a refused connection or a host that does not resolve at once, and the
error names the address and the fix; anything slower (a firewall that drops packets) is left to the
SDK and our bound. The SDK and its retries are untouched. Behind a proxy (``HTTP(S)_PROXY`` for the
host) the SDK's requests go through it, so no direct connect is tried.
"""
from __future__ import annotations

import socket
import urllib.request
from urllib.parse import urlsplit

CONNECT_S = 3.0  # the connect's own bound: a host that does not answer in this is left to the SDK


def check_server(uri: str, what: str = "MLflow", setting: str = "tracker.mlflow.tracking_uri") -> None:
    """Raise ``ConnectionError`` naming ``uri`` and the fix when ``uri`` is http(s) and its port refuses
    a connection or its host does not resolve; ``PermissionError`` / ``NotADirectoryError`` when it is a
    SQLite store that cannot be written (``check_sqlite``); return otherwise."""
    parts = urlsplit(uri)
    if parts.scheme == "sqlite":
        check_sqlite(uri, setting)
        return
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    host = parts.hostname
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(host):
        return  # the SDK reaches the server through the proxy: a direct connect says nothing
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number: the SDK says so in its own words
        return
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except ConnectionRefusedError:
        raise ConnectionError(f"{what} at {uri} refused the connection: nothing listens on {host}:{port}. Start the "
                              f"server (mlflow server --host {host} --port {port}) or set {setting} to one that "
                              "runs") from None
    except socket.gaierror as exc:
        raise ConnectionError(f"{what} at {uri}: the host {host!r} does not resolve ({exc.strerror or exc}); fix "
                              f"{setting}") from None
    except OSError:  # a timeout, no route: the SDK tries (with its retries) within our bound
        return
    if what == "MLflow":
        _speaks_mlflow(uri, setting)


API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # every MLflow tracking server serves it


def _speaks_mlflow(uri: str, setting: str) -> None:
    """Something listens: is it an MLflow tracking server? One GET of its REST API (no retry). ``https://`` to a
    plain-HTTP server fails its TLS handshake, and another web server answers 404: MLflow's client retried the
    first for two minutes and printed the second's whole HTML page per retry, and neither named the setting.
    Any other answer (200, an auth challenge, a server error) is left to the SDK. The probe sends nothing secret
    and does not check the server's certificate: whom to trust is the SDK's settings' (a self-signed server with
    ``MLFLOW_TRACKING_INSECURE_TLS``, a custom CA), not a reason to refuse the URI."""
    import ssl
    import urllib.error

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        urllib.request.urlopen(uri.rstrip("/") + API_PROBE, timeout=CONNECT_S, context=context).close()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise ConnectionError(f"{uri} answers, but not as an MLflow tracking server (GET {API_PROBE}: 404 "
                                  f"{exc.reason}): another web server listens there; fix {setting}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLError):
            raise ConnectionError(f"MLflow at {uri}: the TLS handshake failed ({exc.reason}); if the server speaks "
                                  f"plain HTTP, use http:// in {setting}") from None
    except (OSError, ValueError):  # a timeout, a reset: left to the SDK within our bound
        return


def check_sqlite(uri: str, setting: str = "tracker.mlflow.tracking_uri") -> None:
    """A SQLite store's file must be one this process can create or write: MLflow retries a database it cannot
    open for about two minutes (``unable to open database file``, a warning a retry), so an unwritable path
    cost the run its whole open bound, and the cause named neither the path nor the setting."""
    import tempfile
    from pathlib import Path

    path = uri.split("://", 1)[1] if "://" in uri else ""
    path = path[1:] if path.startswith("/") else path  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    if not path or path == ":memory:" or "?" in path:
        return  # in memory, or URI options the SDK reads: left to it
    db = Path(path)
    folder = db.parent if str(db.parent) else Path(".")
    if db.exists():
        try:  # opened for writing for real: permission bits say nothing to root or on a read-only mount
            with open(db, "r+b"):
                pass
        except OSError as exc:
            raise PermissionError(f"the MLflow store {uri}: {db} cannot be opened for writing ({exc.strerror or exc}); "
                                  f"fix {setting} (a .db file in a folder you can write)") from None
        return
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)  # MLflow makes the rest
    if not existing.is_dir():
        raise NotADirectoryError(f"the MLflow store {uri}: {existing} is a file, not a folder, so the database "
                                 f"cannot be created under it; fix {setting}")
    try:  # a file of our own in the folder, at once removed: whether the database can be created there
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        why = exc.strerror or exc
        raise PermissionError(f"the MLflow store {uri}: the folder {existing} cannot be written ({why}), so the "
                              f"database cannot be created; fix {setting} (a .db file in a folder you can write)") \
            from None
