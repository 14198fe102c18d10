"""The live dashboard, in a real headless browser (Debian's chromium driven by
Playwright): it loads, shows every configured backend with its tier, and marks a
backend cooling within 3 s of its 429. A screenshot goes to test-artifacts/."""

from __future__ import annotations

import shutil

from playwright.sync_api import sync_playwright

from conftest import CHAT_MODEL, REPO_ROOT, Stack, throttled_reply

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_dashboard_shows_backends_and_marks_cooling_within_3s(stack: Stack) -> None:
    # test.sh installs Debian's chromium when it is missing; without it this must fail.
    assert CHROMIUM is not None, "chromium is required (apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(stack.admin_url + "/")
            page.wait_for_selector('tr[data-backend="ptu"][data-state="ready"]', timeout=10_000)
            page.wait_for_selector('tr[data-backend="paygo"][data-state="ready"]', timeout=10_000)
            # Tiers are visible: one header row per priority.
            tiers = page.locator("tr.tier").all_inner_texts()
            assert [t.strip() for t in tiers] == ["priority 1", "priority 2"]

            # ptu throttles: the page marks it within 3 s.
            stack.ptu.script([throttled_reply(30)])
            stack.openai().chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}])
            cooling = 'tr[data-backend="ptu"][data-state="cooling"]'
            page.wait_for_selector(cooling, timeout=3_000)
            row = page.locator(cooling)
            # Marked: the row's class colours it, and its state cell says that a
            # deployment (not the whole resource) is cooling, and why.
            assert row.get_attribute("class") == "cooling"
            assert row.locator("td.state").inner_text() == "cooling (deployment)"
            assert "429" in row.inner_text()
            assert page.locator('tr[data-backend="paygo"]').get_attribute("data-state") == "ready"
            # Let the chart draw a few points, then keep a picture of it.
            page.wait_for_timeout(2_000)
            artifacts = REPO_ROOT / "test-artifacts"
            artifacts.mkdir(exist_ok=True)
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
            assert page.locator("#chart polyline").count() == 2
            assert page.locator("#error").inner_text() == ""
        finally:
            browser.close()
