"""The documentation site: a strict mkdocs build, and the built pages in a real headless browser.

The build never skips (mkdocs is in the ``dev`` extra). The browser checks need Debian's
``chromium`` package (``apt-get install chromium``; ``.ci/run`` installs it) and skip only
when it is missing. Playwright drives that Chromium directly: ``playwright install`` (which
downloads a browser of its own) is never needed.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Each test here runs a script or builds the site: seconds each.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


def mkdocs_build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=config_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = mkdocs_build(ROOT, out)
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}")
    return out


def test_strict_build_renders_every_page_and_the_api(site: Path) -> None:
    pages = sorted(p.relative_to(DOCS) for p in DOCS.rglob("*.md"))
    assert len(pages) >= 20
    for page in pages:
        html = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (site / page.parent / html).is_file(), f"{page} was not built"
    api = (site / "api" / "checkpoint" / "index.html").read_text()
    # Rendered from the docstrings: the function's anchor, its Args and its doctest as code.
    assert 'id="trainperf.checkpoint.load_checkpoint"' in api
    assert "weights_only" in api
    assert '<span class="gp">&gt;&gt;&gt; </span>' in api
    assert ":func:" not in (site / "api" / "ddp" / "index.html").read_text()


def test_strict_build_fails_on_a_broken_anchor_and_a_page_left_out(tmp_path: Path) -> None:
    for name in ("docs", "tools"):
        shutil.copytree(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copy(ROOT / "README.md", tmp_path)  # getting-started includes its install block
    (tmp_path / "src").symlink_to(ROOT / "src")
    with (tmp_path / "docs" / "troubleshooting.md").open("a") as f:
        f.write("\nSee [devices](device.md#no-such-heading).\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    proc = mkdocs_build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0
    assert "does not contain an anchor '#no-such-heading'" in proc.stderr
    assert "orphan.md" in proc.stderr


def test_getting_started_example_runs(tmp_path: Path) -> None:
    text = (DOCS / "getting-started.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    assert "autotune_loader" in example and "save_checkpoint" in example
    (tmp_path / "example.py").write_text(example)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "DataLoader tuning" in proc.stdout
    assert "trainperf.watch:" in proc.stdout
    assert (tmp_path / "runs" / "last.pt").is_file()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class Browser:
    """A Chromium page plus the errors it reported (console errors and uncaught exceptions)."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _on_console(self, msg: Any) -> None:
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        # No internet here: a failed fetch from another host is not the site's fault.
        if msg.text.startswith("Failed to load resource") and not url.startswith(self.base_url):
            return
        self.errors.append(f"console error: {msg.text} ({url})")

    def open(self, path: str) -> None:
        self.page.goto(self.base_url + path, wait_until="networkidle")

    def heading(self) -> str:
        text: str = self.page.locator("article h1").first.inner_text()
        return text.replace("¶", "").strip()


@pytest.fixture
def browser(base_url: str) -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip(
            "Chromium is not installed: apt-get install -y chromium (Debian's package) "
            "to run the documentation site in a headless browser"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = instance.new_page()
            yield Browser(page, base_url)
            page.close()
        finally:
            instance.close()


def test_home_and_api_pages_load_without_errors(browser: Browser) -> None:
    browser.open("")
    assert browser.page.title() == "trainperf"
    assert browser.heading() == "trainperf"
    browser.open("api/ddp/")
    assert browser.heading() == "trainperf.ddp"
    assert browser.page.locator('[id="trainperf.ddp.launch"]').is_visible()
    assert browser.errors == []


def test_search_runs_offline(browser: Browser) -> None:
    from playwright.sync_api import expect

    browser.open("")
    # The search index is built at build time and searched by mkdocs-material's JavaScript
    # in a web worker: a result proves the bundle and the worker load from the site itself.
    query = browser.page.locator(".md-search__input")
    query.click()
    query.press_sequentially("load_checkpoint")  # the search listens to key events
    expect(browser.page.locator(".md-search-result__meta")).to_contain_text("matching")
    hits = browser.page.locator(".md-search-result__link")
    hrefs = [hits.nth(i).get_attribute("href") or "" for i in range(hits.count())]
    assert any("api/checkpoint/" in href for href in hrefs), hrefs
    assert browser.errors == []


def test_navigation_links_lead_to_their_pages(browser: Browser) -> None:
    browser.open("")
    nav = browser.page.locator("nav.md-nav--primary")
    nav.get_by_role("link", name="Getting started", exact=True).click()
    browser.page.wait_for_url(browser.base_url + "getting-started/")
    assert browser.heading() == "Getting started"
    nav.get_by_role("link", name="trainperf.checkpoint", exact=True).click()
    browser.page.wait_for_url(browser.base_url + "api/checkpoint/")
    assert browser.heading() == "trainperf.checkpoint"
    assert browser.page.locator('[id="trainperf.checkpoint.save_checkpoint"]').is_visible()
    assert browser.errors == []
