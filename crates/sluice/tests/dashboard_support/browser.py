#!/usr/bin/env python3
"""Drives the sluice dashboard in headless Chromium (Selenium + chromedriver) for
tests/dashboard_browser.rs, and prints one JSON object with what it saw.

usage: browser.py URL OUTDIR [--token TOKEN]

Checks, each reported as a field (the Rust test asserts them):
- the page gets live data (body[data-seq] grows) and its numbers move (devices -> sluice
  message total grows);
- its device count and per-shard MQTT counts equal /api/v1/status within a refresh (3 s);
- no console error (with --token: none after the token was entered; the tokenless first
  load's 401 is expected and drained);
- every resource it loaded came from the gateway's origin;
- at 1280 and at 390 CSS px wide a screenshot is saved in OUTDIR, and at 390 px the page
  does not scroll sideways.
"""
import json
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def fail(msg):
    print(json.dumps({"error": msg}))
    sys.exit(1)


def get_json(url, token):
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


def main():
    url, outdir = sys.argv[1], sys.argv[2]
    token = None
    if len(sys.argv) > 4 and sys.argv[3] == "--token":
        token = sys.argv[4]
    base = url.rstrip("/")
    opts = Options()
    opts.binary_location = "/usr/bin/chromium"
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1000", "--no-first-run", "--disable-extensions"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    result = {}
    try:
        driver.set_page_load_timeout(20)
        driver.get(base + "/")
        if token:
            deadline = time.time() + 10
            while not driver.find_element(By.ID, "token-form").is_displayed():
                if time.time() > deadline:
                    fail("the token form did not appear")
                time.sleep(0.1)
            result["token_form_shown"] = True
            before = driver.get_log("browser")  # drains the expected 401
            result["errors_before_token"] = [e["message"] for e in before if e["level"] == "SEVERE"]
            driver.find_element(By.ID, "token-input").send_keys(token)
            driver.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()

        def seq():
            return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-seq") or "0")

        def text(css):
            # One script call reads the element's rendered text: the page redraws its tables
            # every tick, so an element found in one WebDriver call may be gone (stale) by the
            # next.
            return driver.execute_script(
                "const e = document.querySelector(arguments[0]);"
                "if (!e) { throw new Error('no element ' + arguments[0]); }"
                "return e.innerText;",
                css,
            )

        def number(css):
            t = text(css).replace(",", "")
            return int(t) if t.lstrip("-").isdigit() else None

        def wait_data(min_seq, timeout=15):
            deadline = time.time() + timeout
            while seq() < min_seq:
                if time.time() > deadline:
                    fail("no live data: data-seq stayed at %d; live pill says %r" % (seq(), text("#live")))
                time.sleep(0.1)

        wait_data(1)
        s0 = seq()
        total0 = number("[data-k=in-total]")
        # Numbers match /api/v1/status within a refresh: compare until they agree (3 s).
        deadline = time.time() + 3
        while True:
            status = get_json(base + "/api/v1/status", token)
            page_devices = number("#k-devices")
            page_shards = [number("#t-shards tbody tr:nth-child(%d) [data-k=shard-mqtt]" % (i + 1))
                           for i in range(len(status["shards"]))]
            want_shards = [s["connections"] for s in status["shards"]]
            if page_devices == status["devices"] and page_shards == want_shards:
                break
            if time.time() > deadline:
                fail("page devices %r / shards %r vs status devices %r / shards %r"
                     % (page_devices, page_shards, status["devices"], want_shards))
            time.sleep(0.2)
        result["devices_page"] = page_devices
        result["devices_status"] = status["devices"]
        result["shards_page"] = page_shards
        # Numbers move.
        wait_data(s0 + 2)
        result["seq_moved"] = [s0, seq()]
        result["in_total"] = [total0, number("[data-k=in-total]")]
        result["in_rate"] = text("#k-in")
        result["uplink_state"] = text("#t-uplinks tbody tr:first-child td:nth-child(2)")
        result["live"] = text("#live")
        result["chart_points"] = driver.execute_script(
            "return document.querySelector('#c-dev polyline') ? "
            "document.querySelector('#c-dev polyline').getAttribute('points').split(' ').length : 0")
        driver.save_screenshot(outdir + "/dashboard-1280.png")

        # A phone: 390 CSS px wide.
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True})
        driver.refresh()
        if token:
            # sessionStorage keeps the token across the reload: no form this time.
            pass
        wait_data(1)
        wait_data(seq() + 1)
        result["width_390"] = driver.execute_script(
            "return [window.innerWidth, document.documentElement.scrollWidth]")
        result["devices_390"] = number("#k-devices")
        driver.save_screenshot(outdir + "/dashboard-390.png")

        origin = driver.execute_script("return location.origin")
        resources = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        result["foreign_requests"] = [r for r in resources if not r.startswith(origin)]
        logs = driver.get_log("browser")
        result["console_errors"] = [e["message"] for e in logs if e["level"] == "SEVERE"]
        result["screenshots"] = [outdir + "/dashboard-1280.png", outdir + "/dashboard-390.png"]
    finally:
        driver.quit()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
