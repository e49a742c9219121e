"""The OpenAI-compatible REST endpoint (aiohttp), served by each API process (`mooncake serve --role api`):

  POST /v1/completions, POST /v1/chat/completions   (stream: OpenAI SSE ending in `data: [DONE]`)
  GET  /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus)
  POST /tokenize, POST /detokenize                   (vLLM's)

Errors are OpenAI-style bodies: 400 bad input, 404 an unknown model, 401 bad key, 429 predicted SLO miss
(with Retry-After), 503 no live instance or no conductor (with Retry-After), 500 a failure on the way. A
client that disconnects cancels its request, and every instance frees it. /health and /metrics are the
conductor's view of the whole cluster."""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
import uuid

from aiohttp import web

from mooncake.api.echo import Echo
from mooncake.api.edge import TENANT, Edge, check_exposure, limit_connections, read_body, tls_context
from mooncake.api.responses import Shape, usage
from mooncake.api.schemas import (ApiError, ModelLimits, bad, check_model, parse_chat, parse_completion,
                                  parse_detokenize, parse_tokenize)
from mooncake.api.flight import StreamEvent
from mooncake.api.tools import ToolCalls
from mooncake.api.front_door import FrontDoor
from mooncake.config import MooncakeConfig
from mooncake.errors import MooncakeError, Rejected, RequestError, Unavailable
from mooncake.hashing import salt_root

log = logging.getLogger(__name__)

STOP_S = 3.0  # a clean stop waits this long for handlers to send their last event, then cancels them
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


class ApiServer:
    def __init__(self, config: MooncakeConfig, door: FrontDoor, reuse_port: bool = False):
        self.config = config
        self.cfg = config.api
        self.door = door
        self.reuse_port = reuse_port  # several API processes listen on the one port (the kernel spreads them)
        # NOTE: parsing, templating and tokenizing a prompt takes up to a second for a big one: off the event
        # loop, so running streams keep their pace; bounded by api.max_connections (one request each).
        self.tokenizers = concurrent.futures.ThreadPoolExecutor(self.cfg.tokenizer_threads,
                                                                thread_name_prefix="tokenize")
        self.name = "REST API"
        self.runner: web.AppRunner | None = None
        self.url = ""

    @property
    def model_name(self) -> str:
        return self.cfg.model_name or self.config.engine.model

    async def start(self) -> None:
        c = self.door
        self.limits = ModelLimits((self.model_name, c.model.model_id), c.max_model_len,
                                  c.model.config.get("vocab_size", 0), self.cfg.default_max_tokens,
                                  self.cfg.strict_fields)
        check_exposure(self.config)
        self.edge = Edge(self.cfg)
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors, self.edge.middleware])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/v1/models/{model_id}", self.model),
                        web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                        web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        # NOTE: handler_cancellation: a client that goes away cancels its handler, which cancels the request.
        # keepalive_timeout: aiohttp closes a connection whose next request is not read by then, so it bounds
        # both an idle connection and one whose headers trickle in (slowloris).
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    keepalive_timeout=self.cfg.header_timeout_s, shutdown_timeout=STOP_S)
        await self.runner.setup()
        limit_connections(self.runner.server, self.cfg.max_connections)
        tls = tls_context(self.cfg)
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port, ssl_context=tls,
                           reuse_port=self.reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise MooncakeError(f"REST API: cannot listen on api.host:api.port = {self.cfg.host}:{self.cfg.port}: "
                                f"{exc}") from None
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://{self.cfg.host}:{port}"
        log.info("REST API at %s/v1 (model '%s')", self.url, self.model_name)

    async def stop(self) -> None:
        if self.runner is not None:
            # NOTE: its streams end with an error event first, so their handlers return and the clients know;
            # aiohttp's cleanup cancels the handlers still running (see _stream for what they then say).
            self.door.end_streams()
            await self.door.drained(STOP_S)
            await self.runner.cleanup()
            self.runner = None
        self.tokenizers.shutdown(wait=False, cancel_futures=True)

    # -- middleware ---------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            response = web.json_response(exc.body(), status=exc.status, headers=exc.headers)
            if exc.status == 408:  # NOTE: the rest of the body may still come: the connection cannot go on
                response.force_close()
            return response
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(ApiError(413, f"the request body is over {self.cfg.max_body_bytes} bytes")
                                     .body(), status=413)
        except web.HTTPException as exc:
            return web.json_response(ApiError(exc.status, exc.reason).body(), status=exc.status)
        except Exception:  # noqa: BLE001  a bug must cost one request, not the server
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(ApiError(500, "internal error; see the API process's log",
                                              type_="server_error").body(), status=500)

    async def _json(self, request):
        body = await read_body(request, self.cfg.body_timeout_s)  # NOTE: its size is checked as it is read
        try:
            return await self._off_loop(json.loads, body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from None

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizers, fn, *args)

    # -- routes ---------------------------------------------------------------------------------------

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "mooncake",
                "max_model_len": self.limits.max_model_len}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        check_model(request.match_info["model_id"], self.limits)
        return web.json_response(self._model_card())

    async def tokenize(self, request):
        ids = await self._off_loop(parse_tokenize, await self._json(request), self.door.tokenizer, self.limits)
        return web.json_response({"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids})

    async def detokenize(self, request):
        ids = parse_detokenize(await self._json(request), self.limits)
        return web.json_response({"prompt": await self._off_loop(self.door.tokenizer.decode, ids)})

    async def health(self, request):
        try:
            instances = (await self.door.cluster()).health
        except Unavailable as exc:
            return web.json_response({"status": "unavailable", "error": str(exc)}, status=503,
                                     headers={"Retry-After": _seconds(exc.retry_after_s)})
        ok = bool(instances.get("decode") and (instances.get("prefill") or instances.get("mode") == "colocated"))
        return web.json_response({"status": "ok" if ok else "unavailable", **instances}, status=200 if ok else 503)

    async def metrics(self, request):
        try:
            text = (await self.door.cluster()).metrics
        except Unavailable as exc:
            raise ApiError(503, str(exc), type_="server_error", code="no_conductor",
                           headers={"Retry-After": _seconds(exc.retry_after_s)}) from None
        body = text.encode() + self.door.metrics.exposition()  # NOTE: the cluster's, then this process's own
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def completions(self, request):
        return await self._serve(request, parse_completion, chat=False)

    async def chat_completions(self, request):
        return await self._serve(request, parse_chat, chat=True)

    async def _serve(self, request, parse, chat: bool):
        body = await self._json(request)
        parsed = await self._off_loop(parse, body, self.door.tokenizer, self.limits)
        tenant = request[TENANT]
        if tenant.cache_salt or parsed.cache_salt:  # NOTE: a key's salt first: no request names its way out of it
            salted = dataclasses.replace(parsed.params, prefix_root=salt_root(tenant.cache_salt, parsed.cache_salt))
            parsed = dataclasses.replace(parsed, params=salted)
        tokens = parsed.n * sum(len(p) + parsed.params.max_tokens for p in parsed.prompts)
        with self.edge.admitted(tenant, parsed.num_choices, tokens):
            flights = await self._submit(parsed)
            try:
                return await self._answer(request, body, parsed, flights, chat)
            finally:
                # NOTE: a client that goes away before a stream starts must not leave its requests behind.
                for flight in flights:
                    self.door.abandon(flight)

    async def _answer(self, request, body, parsed, flights: list, chat: bool):
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = Shape(chat, response_id, int(time.time()), parsed.model, body.get("return_token_ids") is True,
                      self.door.tokenizer)
        echo, tools = Echo(parsed, flights, self.door.tokenizer), ToolCalls(parsed.tools)
        if parsed.stream:
            return await self._stream(request, flights, shape, parsed, echo, tools)
        asked = parsed.params.logprobs is not None
        outs = [("", [], None, [] if asked else None, None, None)] * len(flights)

        async def add(i, event):
            event, shown = echo(i, tools(i, event))
            text, token_ids, _, logprobs, prompt_logprobs, calls = outs[i]
            outs[i] = (text + event.text, token_ids + event.token_ids, event.finish_reason,
                       logprobs + (event.logprobs or []) if asked else None, prompt_logprobs or shown,
                       (calls or []) + event.tool_calls if event.tool_calls else calls)
        try:
            await self._relay(flights, add)
        except RequestError as exc:
            raise ApiError(400 if exc.is_invalid else 500, str(exc), type_="invalid_request_error"
                           if exc.is_invalid else "server_error", code="request_failed") from None
        return web.json_response(shape.whole(outs, usage(flights, parsed.n, parsed.generates)))

    async def _submit(self, parsed) -> list:
        """One request per choice, in choice order (prompt j's choice i, with seed + i when a seed is given);
        if any is refused, the others are let go and the refusal is the answer."""
        flights = []
        try:
            for prompt in parsed.prompts:
                for i in range(parsed.n):
                    params = parsed.params
                    if i and params.seed is not None:
                        params = dataclasses.replace(params, seed=params.seed + i)
                    flights.append(await self.door.submit(prompt, params))
        except BaseException as exc:  # NOTE: any refusal or failure lets go of the choices already placed
            for flight in flights:
                self.door.abandon(flight)
            if isinstance(exc, Rejected):
                raise ApiError(429, str(exc), code=exc.reason, type_="rate_limit_error",
                               headers={"Retry-After": _seconds(exc.retry_after_s)}) from None
            if isinstance(exc, Unavailable):
                raise ApiError(503, str(exc), type_="server_error", code="no_instance",
                               headers={"Retry-After": _seconds(exc.retry_after_s)}) from None
            if isinstance(exc, RequestError):
                raise ApiError(400 if exc.is_invalid else 500, str(exc), type_="invalid_request_error"
                               if exc.is_invalid else "server_error", code="request_failed") from None
            raise
        return flights

    async def _relay(self, flights: list, on_event) -> None:
        """Run every choice's stream at once, awaiting `on_event(index, event)` as events come; the first
        failure ends the others (each then frees its request everywhere) and is raised."""
        async def one(i, flight):
            async with contextlib.aclosing(self.door.stream(flight)) as events:
                async for event in events:
                    await on_event(i, event)
        tasks = [asyncio.ensure_future(one(i, f)) for i, f in enumerate(flights)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stream(self, request, flights: list, shape: Shape, parsed, echo: Echo, tools: ToolCalls):
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        held: dict[int, list] = {}  # per choice: events not sent yet (api.stream_interval), after its first
        interval = self.cfg.stream_interval

        async def send(i, event, shown=None):
            if interval > 1:  # NOTE: a choice's first event and its last go at once, the rest by `interval`
                if i in held:
                    held[i].append(event)
                    if event.finish_reason is None and sum(len(e.token_ids) for e in held[i]) < interval:
                        return
                    event = _merged(held[i])
                held[i] = []
            await _send(response, shape.chunk(i, event.text, event.token_ids, event.finish_reason,
                                              logprobs=event.logprobs, prompt_logprobs=shown,
                                              tool_calls=event.tool_calls))

        async def relay(i, event):
            await send(i, *echo(i, tools(i, event)))

        async def flush():  # what the choices were holding, before the stream ends otherwise
            for i, events in list(held.items()):
                if events:
                    del held[i]
                    await send(i, _merged(events))
        try:
            if shape.chat:
                for i in range(len(flights)):
                    await _send(response, shape.chunk(i, "", [], None, first=True))
            await self._relay(flights, relay)
            if parsed.include_usage:
                await _send(response, shape.usage_chunk(usage(flights, parsed.n, parsed.generates)))
        except RequestError as exc:
            await flush()
            await _send(response, ApiError(500, str(exc), type_="server_error", code="request_failed").body())
        except ConnectionResetError:
            log.info("client went away; request %s cancelled", ", ".join(f.request_id for f in flights))
            return response
        except asyncio.CancelledError:  # NOTE: this process is stopping (or the client left): say so if it hears
            stopping = ApiError(503, "the API process is shutting down; retry", type_="server_error",
                                code="shutting_down").body()
            try:
                await asyncio.wait_for(_send(response, stopping), 0.5)
            except Exception:  # noqa: BLE001  it cannot be told: cut the connection, so it never reads a clean end
                if request.transport is not None:
                    request.transport.abort()
            raise
        except Exception:  # noqa: BLE001  a bug: the stream still ends with an error event, never silently
            log.exception("streaming request %s failed", ", ".join(f.request_id for f in flights))
            await _send(response, ApiError(500, "internal error; see the API process's log",
                                           type_="server_error").body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response




def _merged(events: list) -> StreamEvent:
    """Consecutive events of one choice as one."""
    logprobs = None if events[0].logprobs is None else [lp for e in events for lp in e.logprobs or ()]
    calls = [c for e in events for c in e.tool_calls or ()]
    return StreamEvent("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                       events[-1].finish_reason, logprobs, tool_calls=calls or None)


def _seconds(s: float) -> str:
    return str(max(1, round(s)))


async def _send(response, obj: dict) -> None:
    await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
