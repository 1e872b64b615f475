"""A headless-Chromium driver for the attention page's browser test (the `browser` fixture in conftest.py)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class Chromium:
    """Headless chromium driven with the DevTools protocol over a pipe (JSON ending in NUL on fds 3, 4).

    The pipe needs neither a websocket library nor a driver binary: only Debian's `chromium` package.
    """

    def __init__(self, binary: str, profile: Path) -> None:
        to_child, self._out = os.pipe()  # chromium reads commands on its fd 3
        self._in, from_child = os.pipe()  # and writes replies and events on its fd 4

        def plumb() -> None:  # in the child before exec; dup first, so neither end is overwritten
            read, write = os.dup(to_child), os.dup(from_child)
            os.dup2(read, 3)
            os.dup2(write, 4)

        command = [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        self.process = subprocess.Popen(command, close_fds=False, preexec_fn=plumb,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer, self._id, self.session = b"", 0, None
        self.events: list[dict] = []

    def call(self, method: str, **params: Any) -> dict:
        """Send one command (to the attached page, once there is one) and wait for its reply."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    assert "error" not in reply, f"{method}: {reply['error']}"
                    return reply["result"]
                self.events.append(reply)
            ready, _, _ = select.select([self._in], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._in, 1 << 16) if ready else b""
            assert chunk, f"chromium gave no reply to {method}"
            self._buffer += chunk

    def open(self, page: Path | str) -> None:
        """Open a file, or a URL, in a new target and wait until it has loaded."""
        url = page.as_uri() if isinstance(page, Path) else page
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Runtime.enable")
        # The new target shows about:blank (already "complete") before it navigates: wait for the page.
        loaded = f"document.readyState === 'complete' && location.href === {json.dumps(url)}"
        for _ in range(200):
            if self.js(loaded):
                return
            time.sleep(0.05)
        raise AssertionError(f"{page} did not finish loading")

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def press(self, selector: str, key: str) -> None:
        """Focus an element and press a key on it, as a reader with a keyboard would."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=KEYS[key])

    def hover(self, selector: str) -> None:
        """Move the mouse over the middle of an element."""
        found = f"document.querySelector({json.dumps(selector)})"
        box = json.loads(self.js(f"JSON.stringify({found}.getBoundingClientRect())"))
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box["x"] + box["width"] / 2,
                  y=box["y"] + box["height"] / 2)

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(timeout=10)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            os.close(self._out)
            os.close(self._in)


KEYS = {"ArrowDown": 40, "ArrowUp": 38}
