"""Control requests (settings changes over HTTP): who may send them and from where.

The gate itself (``AuthConfig.check``, the start-up decision, the token sources) is
tested as plain functions; the real server on 127.0.0.1 then shows the reported
attack refused with nothing changed, the token path end to end, and the identity
that lands in the settings history.
"""

from __future__ import annotations

import hashlib
import asyncio
import json
import time

import httpx
import orjson
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.routing import Route

from batchscope.storage.db import make_engine
from batchscope.storage.schema import EventRecord
from runtime.api.config import ServerConfig
from runtime.api.errors import BatchScopeError, ClientError, ConfigError, error_answer
from runtime.models.toys import DoubleModel
from runtime.server.auth import (ENV_TOKEN, AuthConfig, Forbidden, Unauthorized,
                                 auth_for_listening, is_loopback, read_token_file, token_from,
                                 token_identity)
from runtime.server.service import Service, ServiceThread

TOKEN = "s3cret-token-for-tests-0123456789"
IDENTITY = "token:" + hashlib.sha256(TOKEN.encode()).hexdigest()[:8]
JSON = {"content-type": "application/json"}
LOCAL = {**JSON, "host": "127.0.0.1:8000"}
WAIT_S = 20.0


def refused(auth: AuthConfig, headers: dict, peer: str | None = "127.0.0.1",
            method: str = "PATCH") -> BatchScopeError:
    with pytest.raises(BatchScopeError) as info:
        auth.check(method, headers, peer)
    return info.value


# -- the gate as a function ------------------------------------------------------------
def test_loopback_without_token_accepts_same_origin_json():
    auth = AuthConfig()
    assert auth.check("PATCH", LOCAL, "127.0.0.1") == "loopback"
    assert auth.check("POST", {**LOCAL, "content-type": "application/json; charset=utf-8"},
                      "::1") == "loopback"
    assert auth.check("POST", {**LOCAL, "origin": "http://127.0.0.1:8000"},
                      "127.0.0.1") == "loopback"
    assert auth.check("POST", {**LOCAL, "sec-fetch-site": "same-origin"},
                      "127.0.0.1") == "loopback"
    assert auth.check("POST", JSON, "127.0.0.1") == "loopback"  # HTTP/1.0: no Host
    assert auth.check("GET", {}, "10.0.0.9") == "loopback"  # reads are not control requests


def test_the_reported_attack_is_refused():
    # a page on another site posting text/plain (no preflight) to the local server
    error = refused(AuthConfig(), {"content-type": "text/plain", "host": "127.0.0.1:8000",
                                   "origin": "http://evil.example"}, method="POST")
    assert isinstance(error, Forbidden) and error.http_status == 403
    assert "evil.example" in error.message


@pytest.mark.parametrize("headers, status, fragment", [
    ({**LOCAL, "origin": "http://evil.example"}, 403, "other origins"),
    ({**LOCAL, "origin": "http://127.0.0.1:9999"}, 403, "other origins"),
    ({**LOCAL, "origin": "null"}, 403, "other origins"),
    ({**LOCAL, "sec-fetch-site": "cross-site"}, 403, "Sec-Fetch-Site: cross-site"),
    ({**LOCAL, "sec-fetch-site": "same-site"}, 403, "Sec-Fetch-Site: same-site"),
    # the browser says the page is another site's: refused even with an Origin that matches
    ({**LOCAL, "origin": "http://127.0.0.1:8000", "sec-fetch-site": "cross-site"}, 403,
     "Sec-Fetch-Site: cross-site"),
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, so Origin == Host
    ({**JSON, "host": "evil.example:8000", "origin": "http://evil.example:8000"}, 403,
     "loopback address in Host"),
    ({"host": "127.0.0.1:8000", "content-type": "text/plain"}, 400, "application/json"),
    ({"host": "127.0.0.1:8000", "content-type": "application/x-www-form-urlencoded"}, 400,
     "application/json"),
    ({"host": "127.0.0.1:8000"}, 400, "no Content-Type"),
])
def test_cross_site_and_non_json_control_requests_are_refused(headers, status, fragment):
    error = refused(AuthConfig(), headers)
    assert error.http_status == status and fragment in error.message


def test_every_copy_of_origin_and_sec_fetch_site_counts():
    """Before: only the first copy was read, so a second, cross-site one (as a proxy
    that joins headers may pass on) went through."""
    from starlette.datastructures import Headers

    for extra in ([(b"origin", b"http://127.0.0.1:8000"), (b"origin", b"http://evil.example")],
                  [(b"sec-fetch-site", b"none"), (b"sec-fetch-site", b"cross-site")]):
        headers = Headers(raw=[(b"host", b"127.0.0.1:8000"),
                               (b"content-type", b"application/json"), *extra])
        error = refused(AuthConfig(), headers, method="POST")
        assert isinstance(error, Forbidden), error
    one = Headers(raw=[(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                       (b"origin", b"http://127.0.0.1:8000")])
    assert AuthConfig().check("POST", one, "127.0.0.1") == "loopback"


@pytest.mark.parametrize("auth, headers, fragment", [
    (AuthConfig(), {"host": "127.0.0.1:8000", "origin": "https://evil.example"},
     "other origins"),
    (AuthConfig(), {"host": "127.0.0.1:8000", "sec-fetch-site": "cross-site"},
     "Sec-Fetch-Site: cross-site"),
    # DNS rebinding: the page's name resolves to 127.0.0.1; without a token, refused
    (AuthConfig(), {"host": "evil.example:8000"}, "loopback address in Host"),
    (AuthConfig(token=TOKEN, loopback_only=False),
     {"host": "models.example:8000", "origin": "https://evil.example"}, "other origins"),
])
def test_a_costly_read_is_refused_to_other_sites_and_rebound_names(auth, headers, fragment):
    with pytest.raises(Forbidden) as info:
        auth.check_costly_read(headers)
    assert fragment in info.value.message


def test_a_costly_read_needs_no_token():
    AuthConfig().check_costly_read({"host": "127.0.0.1:8000"})
    AuthConfig().check_costly_read({"host": "localhost:8000",
                                    "origin": "http://localhost:8000"})
    AuthConfig().check_costly_read({})  # HTTP/1.0: no Host
    # a server with a token, reached by its own name from a script
    AuthConfig(token=TOKEN, loopback_only=False).check_costly_read({"host": "models:8000"})


def test_without_token_only_loopback_peers_may_change_settings():
    error = refused(AuthConfig(), LOCAL, peer="192.168.1.20")
    assert isinstance(error, Unauthorized) and "Authorization: Bearer <token>" in error.message
    assert isinstance(refused(AuthConfig(), LOCAL, peer=None), Unauthorized)
    # beyond loopback without a token (not buildable by auth_for_listening): nothing passes
    error = refused(AuthConfig(loopback_only=False), LOCAL)
    assert isinstance(error, Forbidden) and "--control-token-file" in error.message


def test_token_missing_is_401_wrong_is_403_right_gives_its_identity():
    auth = AuthConfig(token=TOKEN, loopback_only=False)
    missing = refused(auth, {**JSON, "host": "gpu-box:8000"}, peer="10.1.2.3")
    assert isinstance(missing, Unauthorized) and missing.http_status == 401
    assert "Authorization: Bearer <token>" in missing.message
    basic = refused(auth, {**JSON, "authorization": "Basic dXNlcjpwdw=="}, peer="10.1.2.3")
    assert basic.http_status == 401 and "Bearer" in basic.message
    wrong = refused(auth, {**JSON, "authorization": "Bearer " + TOKEN[:-1] + "X"},
                    peer="10.1.2.3")
    assert isinstance(wrong, Forbidden) and wrong.http_status == 403
    assert TOKEN not in wrong.message
    right = {**JSON, "host": "gpu-box:8000", "authorization": f"Bearer {TOKEN}"}
    assert auth.check("PATCH", right, "10.1.2.3") == IDENTITY == token_identity(TOKEN)
    # a browser on another origin is refused even with the token
    assert refused(auth, {**right, "origin": "http://evil.example"}).http_status == 403
    assert auth.check("PATCH", {**right, "origin": "https://gpu-box:8000"}, "10.1.2.3")
    # the non-JSON check still holds after the token
    assert refused(auth, {**right, "content-type": "text/plain"}).http_status == 400


def test_a_configured_token_is_required_on_loopback_too():
    auth = AuthConfig(token=TOKEN, loopback_only=True)
    assert refused(auth, LOCAL).http_status == 401
    assert auth.check("POST", {**LOCAL, "authorization": f"bearer {TOKEN}"}, "127.0.0.1") == IDENTITY


def test_refusals_are_json_error_answers():
    for error in (refused(AuthConfig(), {**LOCAL, "origin": "http://evil.example"}),
                  refused(AuthConfig(token=TOKEN), LOCAL),
                  refused(AuthConfig(), {"host": "127.0.0.1"})):
        status, _, body = error_answer(error, "PATCH /v2/models/m/batching")
        assert status == error.http_status and set(orjson.loads(body)) == {"error"}


# -- the start-up decision and the token sources ---------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "gpu-box.internal"])
def test_listening_beyond_loopback_without_token_refuses_to_start(host):
    with pytest.raises(ConfigError) as info:
        auth_for_listening(host, None)
    message = info.value.message
    assert "--control-token-file" in message and ENV_TOKEN in message and "\n" not in message
    assert auth_for_listening(host, TOKEN) == AuthConfig(token=TOKEN, loopback_only=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "[::1]"])
def test_loopback_needs_no_token(host):
    assert is_loopback(host)
    assert auth_for_listening(host, None) == AuthConfig(token=None, loopback_only=True)


def test_cli_refuses_to_serve_beyond_loopback_without_token(tmp_path):
    from runtime.tools.cli import UsageError, build_parser, serve_auth

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    with pytest.raises(UsageError) as info:
        serve_auth(args, environ={})
    assert "needs a control token" in str(info.value)
    assert serve_auth(args, environ={ENV_TOKEN: TOKEN}).token == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--control-token-file",
                                      str(path)])
    assert serve_auth(args, environ={}) == AuthConfig(token=TOKEN, loopback_only=False)


def test_token_sources():
    assert token_from(None, None, {}) is None
    assert token_from(TOKEN, None, {ENV_TOKEN: "another-token-0123456789"}) == TOKEN
    assert token_from(None, None, {ENV_TOKEN: f" {TOKEN}\n"}) == TOKEN
    for flag, env, fragment in (("short", {}, "at least 16"),
                                ("has a space in it 0123456789", {}, "without spaces"),
                                (None, {ENV_TOKEN: "tiny"}, ENV_TOKEN)):
        with pytest.raises(ConfigError, match=fragment if fragment != ENV_TOKEN else r"\$"):
            token_from(flag, None, env)
    with pytest.raises(ConfigError, match="not both"):
        token_from(TOKEN, "/some/file", {})


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token_file(path)
    path.chmod(0o600)
    assert read_token_file(path) == TOKEN
    path.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_token_file(tmp_path / "missing")


# -- the real server -------------------------------------------------------------------
def settings_events(db) -> list[dict]:
    with Session(db) as session:
        rows = session.execute(select(EventRecord.details_json)
                               .where(EventRecord.kind == "settings_change")
                               .order_by(EventRecord.id)).scalars().all()
    return [json.loads(r) for r in rows]


def wait_for_events(db, count: int) -> list[dict]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        events = settings_events(db)
        if len(events) >= count:
            return events
        time.sleep(0.02)
    raise AssertionError(f"fewer than {count} settings_change events were recorded")


def serve(tmp_path, auth: AuthConfig | None):
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    service = Service({"mlp": DoubleModel()}, None,
                      ServerConfig(database_url=url, heartbeat_interval_s=0.2,
                                   control_poll_interval_s=0.05), instance_id="auth-test",
                      auth=auth)
    return ServiceThread(service), make_engine(url)


def batch_size(http: httpx.Client) -> tuple[int, int]:
    doc = http.get("/v2/models/mlp/batching").json()
    return doc["version"], doc["settings"]["max_batch_size"]


def test_loopback_server_refuses_cross_site_changes_and_records_who_changed(tmp_path):
    runner, db = serve(tmp_path, None)
    with runner, httpx.Client(base_url=runner.url, timeout=30) as http:
        before = batch_size(http)
        assert before[1] == 32
        # the reported attack, exactly: text/plain with a foreign Origin
        r = http.post("/v2/models/mlp/batching", content=b'{"max_batch_size": 2}',
                      headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert r.status_code == 403 and "other origins" in r.json()["error"]
        r = http.post("/v2/models/mlp/batching", content=b'{"max_batch_size": 2}',
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 400 and "application/json" in r.json()["error"]
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2},
                       headers={"Origin": "https://evil.example"})
        assert r.status_code == 403
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2},
                       headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2},
                       headers={"Host": "rebound.example:80"})
        assert r.status_code == 403 and "Host" in r.json()["error"]
        assert batch_size(http) == before  # nothing changed
        # a same-origin JSON change from loopback is applied; the note is not the identity
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 4},
                       headers={"X-Requested-By": "token:deadbeef",
                                "Origin": runner.url})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["settings"]["max_batch_size"] == 4 and doc["identity"] == "loopback"
        assert doc["requested_by"] == "token:deadbeef"
        assert batch_size(http) == (before[0] + 1, 4)
    events = wait_for_events(db, 1)
    assert [e["requested_by"] for e in events] == ["loopback"]


def test_server_with_token_wants_it_and_records_its_identity(tmp_path):
    runner, db = serve(tmp_path, AuthConfig(token=TOKEN))
    with runner, httpx.Client(base_url=runner.url, timeout=30) as http:
        before = batch_size(http)
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2})
        assert r.status_code == 401 and "Authorization: Bearer <token>" in r.json()["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2},
                       headers={"Authorization": "Bearer not-the-token-0123456789"})
        assert r.status_code == 403 and "not this server's" in r.json()["error"]
        # unauthenticated callers learn nothing about which models exist
        assert http.patch("/v2/models/nope/batching", json={}).status_code == 401
        assert batch_size(http) == before
        r = http.patch("/v2/models/mlp/batching", json={"max_batch_size": 2},
                       headers={"Authorization": f"Bearer {TOKEN}", "X-Requested-By": "ops"})
        assert r.status_code == 200, r.text
        assert r.json()["identity"] == IDENTITY and r.json()["requested_by"] == "ops"
        assert batch_size(http) == (before[0] + 1, 2)
        # reading settings and inference need no token
        r = http.post("/v2/models/mlp/infer", json={"inputs": [
            {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
        assert r.status_code == 200, r.text
    events = wait_for_events(db, 1)
    assert [e["requested_by"] for e in events] == [IDENTITY]


INFERENCE_PATHS = ("/infer", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")
#: routes that take POST as Triton's protocol says but change nothing (no control request)
READ_ONLY_POSTS = ("/v2/repository/index",)


def test_every_state_changing_route_refuses_cross_site_requests(tmp_path):
    from runtime.models.decoder import TinyDecoder

    service = Service({"mlp": DoubleModel()}, None, ServerConfig(record=False),
                      generation={"decoder": TinyDecoder(d_model=16, n_layers=1)},
                      instance_id="auth-routes")
    changing = [(method, route.path) for route in service.app.routes if isinstance(route, Route)
                for method in sorted(route.methods or ()) if method not in ("GET", "HEAD")
                and not route.path.endswith(INFERENCE_PATHS + READ_ONLY_POSTS)]
    assert ("PATCH", "/v2/models/{name}/batching") in changing
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=30) as http:
        for name in ("mlp", "decoder"):
            before = http.get(f"/v2/models/{name}/batching").json()
            for method, path in changing:
                target = path.format(name=name, adapter="any")  # adapter routes name one too
                r = http.request(method, target, content=b'{"max_num_seqs": 1}',
                                 headers={"Content-Type": "text/plain",
                                          "Origin": "http://evil.example"})
                assert r.status_code == 403, (method, path, r.text)
            assert http.get(f"/v2/models/{name}/batching").json() == before


def test_non_loopback_socket_without_token_does_not_start():
    service = Service({"mlp": DoubleModel()}, None, ServerConfig(record=False, host="0.0.0.0"),
                      instance_id="auth-refuse")
    with pytest.raises(ConfigError, match="needs a control token"):
        asyncio.run(service.serve())
    assert not service.started.is_set()
