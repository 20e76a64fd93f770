"""Test helpers of the regenerate stage's tests."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import torch


@torch.no_grad()
def greedy(model, prompt_ids, max_new: int, eos: int) -> list[int]:
    """Plain greedy decoding, the reference of the backends: a full forward a step, no cache, no padding."""
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out


class Recorder:
    """Wraps a backend: records every call's requests (``calls``; ``batches``: their ids), raises after
    ``fail_after`` calls (a kill mid-run)."""

    def __init__(self, inner, fail_after: int | None = None):
        self.inner, self.name, self.fail_after, self.calls = inner, inner.name, fail_after, []

    @property
    def batches(self) -> list[list[str]]:
        return [[r.id for r in requests] for requests in self.calls]

    def generate(self, requests):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls.append(list(requests))
        return self.inner.generate(requests)

    def close(self):
        self.inner.close()


class Scripted:
    """A backend that answers each request with ``answer(prompt_text)`` + EOS, reported 'stop' (``finalize_response``
    cuts one of ``max_new_tokens`` ids or more: 'length'); records the prompt texts it got (``texts``)."""

    name = "scripted"

    def __init__(self, tok, answer: Callable[[str], str]):
        self.tok, self.answer, self.texts = tok, answer, []

    def generate(self, requests):
        from dspark_core.data.backends import Generation

        self.texts += [r.prompt_text for r in requests]
        return [Generation(list(self.tok(self.answer(r.prompt_text), add_special_tokens=False)["input_ids"])
                           + [self.tok.eos_token_id], "stop") for r in requests]

    def close(self):
        pass


class CompletionServer:
    """A local OpenAI-style completions server answering ``answer(body)`` to each request after ``delay_s``; it
    records the request bodies it answered (``bodies``) and the most requests it had in flight at once (``peak``)."""

    def __init__(self, answer: Callable[[dict], str], delay_s: float = 0.0) -> None:
        record = self
        self.bodies: list[dict] = []
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _send(self, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send({"object": "list", "data": [{"id": "stub-model"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with record.lock:
                    record.in_flight += 1
                    record.peak = max(record.peak, record.in_flight)
                time.sleep(delay_s)
                with record.lock:
                    record.in_flight -= 1
                    record.bodies.append(body)
                self._send({"choices": [{"index": 0, "text": answer(body), "finish_reason": "stop"}]})

            def log_message(self, *args):
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
