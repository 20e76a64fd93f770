"""Regenerate backend ``openai``: one or several OpenAI-compatible servers (vLLM, SGLang, llama.cpp, ...).

Uses the completions endpoint (``POST {base_url}/completions``) with plain ``urllib`` (no extra
dependency). The prompt is sent as the chat-templated token ids (the OpenAI spec allows a list
of ints), or as the chat-templated text when ``send_token_ids`` is false. The answer text is
re-tokenised with the target's tokenizer; a 'stop' answer gets the EOS id appended by
:func:`~dspark_core.data.backends.base.finalize_response`.

Several servers (``base_url`` a list, e.g. one per GPU): each is probed once when the backend starts
(``GET {url}/models``, which also names its model when ``model`` is None); one that fails its probe is named in a
warning and left out, and the run goes on with the others (none answering: an error naming each). Each server
keeps up to ``concurrency`` requests in flight: ``concurrency`` threads per server take the next request of the
batch as soon as they are free, so a faster server answers more of them. Answers come back in request order,
and each request carries its own seed (:func:`~dspark_core.data.backends.base.request_seed`), so which server
answered it does not change it (the servers serving the same model the same way).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from dspark_core.data.backends.base import Generation, Request, SamplingSpec
from dspark_core.errors import UserError

log = logging.getLogger(__name__)

_ATTEMPTS = 3          # tries per request on connection errors and 5xx answers
_BACKOFF_S = 1.0       # first retry delay, doubled each time


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str | Sequence[str], model: str | None, sampling: SamplingSpec, tokenizer, *,
                 api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 600.0, send_token_ids: bool = True,
                 concurrency: int = 32):
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise UserError("regenerate.openai_base_url names no server")
        self.sampling = sampling
        self.tok = tokenizer
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        self.timeout_s = timeout_s
        self.send_token_ids = send_token_ids
        self.concurrency = max(1, concurrency)
        self.servers = self._probe([u.rstrip("/") for u in urls], model)  # [(base url, model)]

    @property
    def base_url(self) -> str:
        return self.servers[0][0]

    # -- HTTP ------------------------------------------------------------------------------
    def _call(self, base_url: str, method: str, path: str, body: dict | None = None) -> Any:
        url = f"{base_url}{path}"
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        delay = _BACKOFF_S
        for attempt in range(1, _ATTEMPTS + 1):
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
                if e.code < 500 or attempt == _ATTEMPTS:
                    raise UserError(f"{method} {url}: HTTP {e.code}: {detail} (regenerate.openai_base_url / "
                                    "openai_model)") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == _ATTEMPTS:
                    raise UserError(f"{method} {url}: {getattr(e, 'reason', e)} "
                                    f"(is the server up? regenerate.openai_base_url)") from None
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def _probe_one(self, base_url: str, model: str | None) -> str:
        """The server's model (``model``, or the first it lists), once it answered ``GET /models``."""
        data = self._call(base_url, "GET", "/models").get("data") or []
        if model:
            return model
        if not data:
            raise UserError(f"{base_url}/models lists no model; set regenerate.openai_model")
        return str(data[0]["id"])

    def _probe(self, urls: list[str], model: str | None) -> list[tuple[str, str]]:
        """``[(url, model)]`` of the servers that answer their probe, in the given order; the others are named."""
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            futures = [pool.submit(self._probe_one, u, model) for u in urls]
        ok, failed = [], []
        for url, fut in zip(urls, futures):
            try:
                ok.append((url, fut.result()))
            except UserError as e:
                failed.append((url, str(e)))
        if not ok:
            if len(urls) == 1:
                raise UserError(failed[0][1])
            raise UserError("regenerate.openai_base_url: no server answered its probe: "
                            + "; ".join(msg for _, msg in failed))
        for url, msg in failed:
            log.warning("regenerate.openai_base_url: server %s failed its probe and is left out (%s)", url, msg)
        return ok

    # -- generation ------------------------------------------------------------------------
    def _body(self, req: Request, model: str) -> dict:
        s = self.sampling
        body = {"model": model, "max_tokens": s.max_new_tokens, "n": 1,
                "prompt": list(req.prompt_ids) if self.send_token_ids else req.prompt_text}
        if s.greedy:
            body.update(temperature=0.0)
        else:
            body.update(temperature=s.temperature, top_p=s.top_p, seed=req.seed)
            if s.top_k > 0:
                body["top_k"] = s.top_k
        return body

    def _one(self, server: tuple[str, str], req: Request) -> Generation:
        base_url, model = server
        out = self._call(base_url, "POST", "/completions", self._body(req, model))
        try:
            choice = out["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{base_url}/completions: unexpected answer {str(out)[:300]!r} (not an "
                            "OpenAI-compatible completions server? regenerate.openai_base_url)") from None
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return Generation(list(ids), str(choice.get("finish_reason") or "stop"))

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        """One answer per request, in request order; up to ``concurrency`` requests in flight per server."""
        if not requests:
            return []
        out: list[Generation | None] = [None] * len(requests)
        lock, stop = threading.Lock(), threading.Event()
        taken = [0]

        def worker(server: tuple[str, str]) -> None:
            while not stop.is_set():
                with lock:
                    i = taken[0]
                    taken[0] += 1
                if i >= len(requests):
                    return
                try:
                    out[i] = self._one(server, requests[i])
                except BaseException:
                    stop.set()  # the other workers take no new request
                    raise

        n = len(self.servers)
        slots = [self.servers[k % n] for k in range(min(n * self.concurrency, len(requests)))]
        with ThreadPoolExecutor(max_workers=len(slots)) as pool:
            futures = [pool.submit(worker, s) for s in slots]
        for f in futures:
            f.result()  # the first failure, re-raised
        return out  # type: ignore[return-value]  # every slot filled: no worker failed

    def close(self) -> None:
        return None
