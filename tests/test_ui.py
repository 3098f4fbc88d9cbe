"""The built-in page over plain HTTP (issue #48; the browser drives it in tests/test_ui_browser.py):
where it is served, its headers, the guard in front of it, ``--no-ui``, and that it ships."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from superfluid.api._ui import _FILES, ASSETS, CSP
from superfluid.cli._main import _security, build_parser
from superfluid.serving import ApiKey

from .conftest import mock_config, open_daemon

ROOT = Path(__file__).resolve().parent.parent
BROWSER = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


async def test_the_page_and_its_assets_are_served_with_a_strict_policy() -> None:
    async with open_daemon(mock_config()) as d:
        for path, (name, kind) in _FILES.items():
            r = await d.client.get(path)
            assert r.status_code == 200, (path, r.text)
            assert r.headers["content-type"] == kind.decode() and r.content == (ASSETS / name).read_bytes()
            assert r.headers["content-security-policy"] == CSP.decode()
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.headers["x-frame-options"] == "DENY" and r.headers["referrer-policy"] == "no-referrer"
        head = await d.client.head("/ui/app.js")
        assert head.status_code == 200 and head.content == b""
        assert "default-src 'self'" in CSP.decode() and "unsafe-inline" not in CSP.decode()
        # /ui, and / from a browser, go to /ui/; every other client still reads the old answer at /
        r = await d.client.get("/ui")
        assert (r.status_code, r.headers["location"]) == (302, "/ui/")
        r = await d.client.get("/", headers=BROWSER)
        assert (r.status_code, r.headers["location"]) == (302, "/ui/")
        assert (await d.client.get("/")).text == "superfluid is running"  # curl, Ollama clients (Accept: */*)
        err = await d.client.get("/ui/nope.js")
        assert err.status_code == 404 and err.json()["error"]["code"] == "not_found"
        assert (await d.client.post("/ui/app.js", json={})).status_code == 405


def test_the_page_has_no_inline_script_or_style_and_no_remote_resource() -> None:
    """The CSP would block them anyway; this keeps the page from depending on what it blocks."""
    html = (ASSETS / "index.html").read_text()
    assert re.findall(r"<script[^>]*>", html) == ['<script src="app.js" defer>']
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"\son[a-z]+=", html)  # no onclick= and the like
    for name in ("index.html", "app.js", "app.css"):
        text = (ASSETS / name).read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//", text), name
        assert "innerHTML" not in text and "eval(" not in text, name


async def test_no_ui_turns_the_page_off() -> None:
    async with open_daemon(mock_config(ui=False)) as d:
        for path in ("/ui/", "/ui/app.js"):
            r = await d.client.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        assert (await d.client.get("/", headers=BROWSER)).text == "superfluid is running"
    args = build_parser().parse_args(["serve", "--runtime", "mock", "--no-ui"])
    assert _security(args)["ui"] is False
    assert _security(build_parser().parse_args(["serve", "--runtime", "mock"]))["ui"] is True


async def test_the_page_needs_no_key_but_passes_the_host_and_origin_checks() -> None:
    keys = (ApiKey.from_secret("me", "sk-k"),)
    async with open_daemon(mock_config(api_keys=keys)) as d:
        assert (await d.client.get("/ui/")).status_code == 200  # it asks for the key itself
        assert (await d.client.get("/", headers=BROWSER)).status_code == 302
        assert (await d.client.get("/")).status_code == 401  # the API still needs one
        assert (await d.client.get("/v1/models")).status_code == 401
        assert (await d.client.get("/ui/nope.js")).status_code == 401  # only the page's own files are open
        assert (await d.client.post("/ui/app.js", json={})).status_code == 401
    async with open_daemon(mock_config()) as d:
        r = await d.client.get("/ui/", headers={"host": "evil.example"})  # DNS rebinding
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_refused"
        r = await d.client.get("/ui/app.js", headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_refused"
        r = await d.client.get("/ui/", headers={"origin": "http://localhost:9"})
        assert r.status_code == 200


def test_the_assets_ship_as_package_data() -> None:
    """A non-editable install carries superfluid/ui/* (pyproject's package-data)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "ui/*" in config["tool"]["setuptools"]["package-data"]["superfluid"]
    assert ASSETS == ROOT / "superfluid" / "ui"
    assert {name for name, _ in _FILES.values()} == {p.name for p in ASSETS.iterdir()}


async def test_lanes_tell_a_key_only_its_models() -> None:
    """/ui/lanes is an API route: it needs the key, and lists only the models the key may use."""
    keys = (ApiKey.from_secret("all", "sk-all"), ApiKey.from_secret("none", "sk-none", models=("other",)))
    async with open_daemon(mock_config(api_keys=keys)) as d:
        assert (await d.client.get("/ui/lanes")).status_code == 401
        r = await d.client.get("/ui/lanes", headers={"authorization": "Bearer sk-all"})
        assert r.json() == {"object": "list", "data": [{"model": "mock", "lanes": []}]}
        r = await d.client.get("/ui/lanes", headers={"authorization": "Bearer sk-none"})
        assert r.json() == {"object": "list", "data": []}


async def test_the_live_views_polls_do_not_pay_the_rate_limit() -> None:
    """The live view polls /metrics and /ui/lanes every second: both are exempt, as /metrics was."""
    async with open_daemon(mock_config(rate_limit_rpm=2)) as d:
        for _ in range(5):
            assert (await d.client.get("/ui/lanes")).status_code == 200
            assert (await d.client.get("/metrics")).status_code == 200
        assert (await d.client.get("/v1/models")).status_code == 200
        assert (await d.client.get("/v1/models")).status_code == 200
        assert (await d.client.get("/v1/models")).status_code == 429
