"""Regenerate backend ``openai``: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ...).

Uses the completions endpoint (``POST {base_url}/completions``) with plain ``urllib`` (no extra
dependency). The prompt is sent as the chat-templated token ids (the OpenAI spec allows a list
of ints), or as the chat-templated text when ``send_token_ids`` is false. The answer text is
re-tokenised with the target's tokenizer; a 'stop' answer gets the EOS id appended by
:func:`~dspark_core.data.backends.base.finalize_response`.
Requests of one batch run concurrently (one thread each).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from dspark_core.data.backends.base import Generation, Request, SamplingSpec
from dspark_core.errors import UserError

_ATTEMPTS = 3          # tries per request on connection errors and 5xx answers
_BACKOFF_S = 1.0       # first retry delay, doubled each time


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str, model: str | None, sampling: SamplingSpec, tokenizer, *,
                 api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 600.0, send_token_ids: bool = True,
                 concurrency: int = 8):
        self.base_url = base_url.rstrip("/")
        self.sampling = sampling
        self.tok = tokenizer
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        self.timeout_s = timeout_s
        self.send_token_ids = send_token_ids
        self.concurrency = max(1, concurrency)
        self.model = model or self._first_model()

    # -- HTTP ------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        url = f"{self.base_url}{path}"
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
                detail = e.read().decode(errors="replace")[:300]
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

    def _first_model(self) -> str:
        data = self._call("GET", "/models").get("data") or []
        if not data:
            raise UserError(f"{self.base_url}/models lists no model; set regenerate.openai_model")
        return str(data[0]["id"])

    # -- generation ------------------------------------------------------------------------
    def _body(self, req: Request) -> dict:
        s = self.sampling
        body = {"model": self.model, "max_tokens": s.max_new_tokens, "n": 1,
                "prompt": list(req.prompt_ids) if self.send_token_ids else req.prompt_text}
        if s.greedy:
            body.update(temperature=0.0)
        else:
            body.update(temperature=s.temperature, top_p=s.top_p, seed=req.seed)
            if s.top_k > 0:
                body["top_k"] = s.top_k
        return body

    def _one(self, req: Request) -> Generation:
        out = self._call("POST", "/completions", self._body(req))
        try:
            choice = out["choices"][0]
            text = choice["text"]
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{self.base_url}/completions: unexpected answer {str(out)[:300]} (not an "
                            "OpenAI-compatible completions server? regenerate.openai_base_url)") from None
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return Generation(list(ids), str(choice.get("finish_reason") or "stop"))

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def close(self) -> None:
        return None
