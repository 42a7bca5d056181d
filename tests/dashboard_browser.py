"""Drives headless Chromium through `turnstile dashboard` for the dashboard test.

Chromium is started with --headless --no-sandbox and spoken to over the DevTools protocol on
a pipe (--remote-debugging-pipe: commands on fd 3, replies on fd 4, each a JSON message ended
by a NUL byte), so nothing beyond the Python standard library is needed.

The test and this script take turns over stdin/stdout, one line each:
  1. the script loads the page and waits for the first snapshot, then prints `loaded`;
  2. the test starts a run and writes its id; the script waits until the run's tree shows the
     step named by --step running and the session (--session) busy, prints `step running`,
     then waits (same page, no reload) until it shows the step and the run completed and the
     session idle, checks that the page took one snapshot only, saves a screenshot and prints
     `step completed`;
  3. it loads the page again and checks that the snapshot alone shows the completed tree,
     prints `snapshot ok`, writes the page's HTML to --html and exits 0.
Any wait that runs out prints what the page showed and exits 1.

usage: dashboard_browser.py CHROMIUM URL --step NAME --session ID --screenshot PNG --html FILE
"""

import argparse
import base64
import ctypes
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback


PR_SET_PDEATHSIG = 1


class Browser:
    def __init__(self, chromium, log):
        ours_r, chrome_w = os.pipe()  # Chromium writes replies on its fd 4
        chrome_r, ours_w = os.pipe()  # and reads commands on its fd 3

        def fds_3_and_4():
            # Chromium dies with this script, even when the script is SIGKILLed.
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            r = fcntl.fcntl(chrome_r, fcntl.F_DUPFD, 10)
            w = fcntl.fcntl(chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.profile = tempfile.TemporaryDirectory(prefix="turnstile-chromium-")
        self.proc = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile.name}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            close_fds=False,
            preexec_fn=fds_3_and_4,
        )
        os.close(chrome_r)
        os.close(chrome_w)
        self.r, self.w = ours_r, ours_w
        self.buf = b""
        self.next_id = 0
        self.session = None

    def call(self, method, params=None, timeout=30.0):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline):
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium")
            ready, _, _ = select.select([self.r], [], [], left)
            if ready:
                chunk = os.read(self.r, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed its pipe (did it start?)")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\0", 1)
        return json.loads(line)

    def open(self, url):
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call(
            "Target.attachToTarget", {"targetId": target, "flatten": True}
        )["sessionId"]
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
        )
        self.call("Page.navigate", {"url": url})

    def eval(self, expression):
        out = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}
        )
        if "exceptionDetails" in out:
            raise RuntimeError(f"page script: {out['exceptionDetails']}")
        return out.get("result", {}).get("value")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.profile.cleanup()


def state_js(run, step, session):
    return (
        "(() => {"
        f" const r = document.querySelector('[data-run=\"{run}\"]');"
        f" const s = r ? r.querySelector('li.node[data-kind=\"step\"][data-name=\"{step}\"]') : null;"
        f" const l = document.querySelector('tr[data-session=\"{session}\"]');"
        " return { snapshots: document.body.dataset.snapshots, stream: document.body.dataset.stream,"
        "   probe: window.__turnstileProbe || null, run: r ? r.dataset.status : null,"
        "   step: s ? s.dataset.status : null, lane: l ? l.dataset.lane : null,"
        "   tree: r ? r.innerText : null }; })()"
    )


def wait(browser, what, expression, done, timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = browser.eval(expression)
        except RuntimeError as e:  # the page between loads, or a script error: said below
            last = f"error: {e}"
        else:
            if done(last):
                return last
        time.sleep(0.1)
    print(f"timed out waiting for {what}; the page showed: {json.dumps(last)}", flush=True)
    body = browser.eval("document.body.innerText")
    print(f"page text:\n{body}", flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("chromium")
    ap.add_argument("url")
    ap.add_argument("--step", required=True)
    ap.add_argument("--session", required=True)
    ap.add_argument("--screenshot", required=True)
    ap.add_argument("--html", required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--log", default=os.devnull)
    args = ap.parse_args()

    with open(args.log, "ab") as log:
        browser = Browser(args.chromium, log)
        try:
            run(browser, args)
        except Exception:  # said on stdout, where the test reads
            print("failed: " + traceback.format_exc().replace("\n", " | "), flush=True)
            sys.exit(1)
        finally:
            browser.close()


def run(browser, args):
    browser.open(args.url)
    wait(
        browser,
        "the first snapshot",
        "document.body ? document.body.dataset.snapshots : null",
        lambda v: v == "1",
        args.timeout,
    )
    # Gone if the page is ever reloaded.
    browser.eval("window.__turnstileProbe = 'same page'")
    print("loaded", flush=True)

    run_id = sys.stdin.readline().strip()
    if not run_id:
        print("failed: no run id on stdin", flush=True)
        sys.exit(1)
    js = state_js(run_id, args.step, args.session)
    # The run holds the lane while its step runs (R5): the session shows busy, read off the
    # lane and sent when the run's events came.
    wait(
        browser,
        f"step {args.step} running on a busy session",
        js,
        lambda s: s["step"] == "running" and s["lane"] == "busy",
        args.timeout,
    )
    print("step running", flush=True)
    final = wait(
        browser,
        f"step {args.step} and the run completed, the session idle",
        js,
        lambda s: s["step"] == "completed" and s["run"] == "completed" and s["lane"] == "idle",
        args.timeout,
    )
    if final["snapshots"] != "1" or final["probe"] != "same page":
        print(f"failed: the page was reloaded or resynced: {json.dumps(final)}", flush=True)
        sys.exit(1)
    browser.screenshot(args.screenshot)
    print("step completed", flush=True)
    print("tree: " + json.dumps(final["tree"]), flush=True)

    # A fresh page: the snapshot alone shows the finished tree.
    browser.call("Page.navigate", {"url": args.url})
    wait(
        browser,
        "the completed tree from a fresh snapshot",
        js,
        lambda s: s["snapshots"] == "1" and s["probe"] is None
        and s["step"] == "completed" and s["run"] == "completed",
        args.timeout,
    )
    with open(args.html, "w") as f:
        f.write(browser.eval("document.documentElement.outerHTML"))
    print("snapshot ok", flush=True)


if __name__ == "__main__":
    main()
