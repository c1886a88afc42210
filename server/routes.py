"""OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) and /metrics, over EngineService,
which they share with the playground's chat tabs (the same batches, the same dashboard). A client that goes away
mid-request has its request aborted at once (its KV blocks freed).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from engine.inputs import ContextLengthError
from engine.llm import chat_token_ids
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams
from engine.service import EngineService, ServiceBusy

from . import limits, protocol
from .limits import ApiLimits
from .metrics import EngineMetrics
from .protocol import ApiError, Deltas, GenerationRequest, TokenText, sse

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class LoopSink:
    """Hands a request's outputs from the engine thread to the event loop that serves it. If that loop has closed,
    put() raises, and the service aborts the request (nobody is left to read it)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, item: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class ClientGone(Exception):
    pass


class OpenAIApi:
    def __init__(self, service: Callable[[], EngineService], tokenizer, model_name: str, api_key: str | None = None,
                 api_limits: ApiLimits | None = None, seats=None, share: Callable[[Request], object] | None = None
                 ) -> None:
        """`service`: the live engine service (a callable: the playground may restart the engine). `api_key`:
        required as `Authorization: Bearer` on /v1/* (None: open, as vLLM without --api-key); /metrics and
        /health stay open. `seats`: the audience's fair shares of a shared engine (playground.access.Seats), which
        a generation request takes, counted against `share(request)` (playground.access.Access.api_share) unless
        that is None (the presenter's token, or a desk). No `share`: no shares."""
        self.service = service
        self.seats, self.share = seats, share
        self.api_key = api_key or None
        self.limits = api_limits or ApiLimits()
        self.longest_token = limits.longest_token_chars(tokenizer)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self.metrics = EngineMetrics(model_name, lambda: self.service().snapshot())

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/{path:path}", self.not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]

    # ---- small endpoints -------------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is not None and not limits.bearer_ok(request.headers.get("authorization"), self.api_key):
            raise limits.unauthorized()

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it passes the cap: never read whole first."""
        cap = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise limits.too_large(cap)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise limits.too_large(cap)
                chunks.append(chunk)
        except ClientDisconnect as exc:  # gone mid-body (or cut as too slow): nobody to answer, nothing to log
            raise ApiError(499, "the client closed the connection before its body arrived",
                           code="client_closed_request") from exc
        return b"".join(chunks)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return error_response(exc)
        max_len = self.service().snapshot().config["max_model_len"]
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "watch-llm",
            "root": self.model_name, "max_model_len": max_len}]})

    async def prometheus(self, request: Request) -> Response:
        text, content_type = self.metrics.exposition()
        return Response(text, media_type=content_type)

    async def health(self, request: Request) -> Response:
        service = self.service()
        if service.alive and service.paused:  # step mode: requests are taken but wait for someone to press Step
            return error_response(ApiError(503, "the engine is paused (step mode, or a measurement is running): "
                                                "requests wait until it resumes", "service_unavailable",
                                           code="engine_paused"))
        if service.alive:
            return Response(status_code=200)
        return error_response(ApiError(503, f"the engine thread has stopped: {service.stopped_because}",
                                       "service_unavailable", code="engine_stopped"))

    async def not_found(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return error_response(exc)
        path = limits.excerpt(request.url.path)  # a path may be as long as the server reads a request line
        return error_response(ApiError(404, f"no such endpoint: {request.method} {path} (this server has GET "
                                             f"/v1/models, POST /v1/completions, POST /v1/chat/completions)",
                                        "invalid_request_error", code="unknown_url"))

    # ---- generation ------------------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, protocol.parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, protocol.parse_completion)

    async def _generate(self, request: Request, parse) -> Response:
        try:
            self._authorize(request)
            limits.check_content_type(request.headers.get("content-type"))
            body = protocol.parse_json(await self._read_body(request))
            limits.check_sizes(body, self.limits)  # every list's length, before anything walks one
            limits.check_encodable(body)
            req = parse(body, self.model_name)
            service, sink = self.service(), LoopSink()
            self._check_size(req, service.snapshot().config["max_model_len"])
            seat = self._take_seat(request, req)
        except ApiError as exc:
            return error_response(exc)
        try:
            rid, params = await run_in_threadpool(self._submit, service, req, sink)
        except ApiError as exc:
            self._give_back(seat)
            return error_response(exc)

        def done() -> None:  # also when the stream never started, or its client left
            abort_if_open(service, rid)
            self._give_back(seat)
        abort = BackgroundTask(done)
        if req.stream:
            return StreamingResponse(self._stream(service, rid, sink, req, params), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=abort)
        try:
            out = await self._final_output(request, sink)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        finally:
            done()
        if out.error:
            return error_response(engine_stopped(out.error))
        return JSONResponse(self._response(req, out))

    def _take_seat(self, request: Request, req: GenerationRequest):
        """The audience's share this request takes (the visitor it is counted against), or None when it is not
        capped; a max_tokens above the audience's cap is refused, a missing one becomes the cap."""
        who = self.share(request) if self.seats is not None and self.share is not None else None
        if who is None:
            return None
        if req.priority < 0:  # ahead of the other people on a shared engine: the presenter's alone
            raise protocol.bad_request(f"priority {req.priority}: an audience request's priority on this shared "
                                       f"engine is 0 or more (lower goes first)", "priority")
        cap, asked = self.seats.max_tokens, req.sampling.get("max_tokens")
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > cap:
            raise protocol.bad_request(f"{req.max_tokens_param or 'max_tokens'}={asked} is above {cap}, the longest "
                                       f"reply each visitor of this shared engine may ask for",
                                       req.max_tokens_param or "max_tokens")
        if asked is None:
            req.sampling["max_tokens"] = cap
        try:
            # the first reply of an address before a flood's sixteenth (Seats.take: how many it already has)
            req.priority = max(req.priority, self.seats.take(who))
        except ValueError as exc:
            raise ApiError(429, str(exc), "rate_limit_exceeded", None, "too_many_requests_in_flight",
                           {"Retry-After": str(RETRY_AFTER_S)}) from exc
        return who

    def _give_back(self, seat) -> None:
        if seat is not None:
            self.seats.give_back(seat)

    def _check_size(self, req: GenerationRequest, max_model_len: int) -> None:
        """A prompt that cannot fit the context, refused by its length alone (no tokenizing)."""
        param = "messages" if req.chat else "prompt"
        if isinstance(req.prompt, str) or req.chat:
            limits.check_prompt_size(len(prompt_text(req)), None, max_model_len, self.longest_token, param)
        else:
            limits.check_prompt_size(0, len(req.prompt), max_model_len, self.longest_token, param)

    def _submit(self, service: EngineService, req: GenerationRequest, sink: LoopSink) -> tuple[str, SamplingParams]:
        """Tokenize (through the chat template for a chat) and submit, on a worker thread: the engine thread gets
        token ids, so tokenizing never holds up its steps, and the default max_tokens needs the prompt's length."""
        max_len = service.snapshot().config["max_model_len"]
        param = "messages" if req.chat else "prompt"
        if not isinstance(req.prompt, list) or req.chat:
            tokenize = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
            if limits.probe_too_long(prompt_text(req), tokenize, max_len, self.limits):
                raise protocol.bad_request(f"the prompt is longer than this model's context of {max_len} tokens "
                                           f"(its start alone is)", param, "context_length_exceeded")
        prompt = req.prompt
        if req.chat:
            try:
                prompt = chat_token_ids(self.tokenizer, req.prompt)
            except Exception as exc:  # the template is the model's code: whatever it raises, these messages did it
                raise protocol.bad_request(f"the model's chat template refused these messages: {exc}",
                                           "messages") from exc
        elif isinstance(prompt, str):
            try:
                prompt = self.tokenizer(prompt).input_ids  # as LLMEngine.add_request tokenizes text
            except Exception as exc:  # the tokenizer's own refusal of this text is the request's fault
                raise protocol.bad_request(f"the tokenizer refused the prompt: {exc}", "prompt") from exc
        params = req.sampling_params(len(prompt), max_len)
        try:
            rid, _ = service.submit(prompt, params, sink, priority=req.priority)
        except ServiceBusy as exc:
            raise ApiError(429, str(exc), "rate_limit_exceeded", None, "too_many_waiting_requests",
                           {"Retry-After": str(RETRY_AFTER_S)}) from exc
        except ContextLengthError as exc:
            raise protocol.bad_request(str(exc), param, "context_length_exceeded") from exc
        except ValueError as exc:
            raise protocol.bad_request(str(exc), param) from exc
        except RuntimeError as exc:  # the engine thread has stopped
            raise engine_stopped(str(exc)) from exc
        return rid, params

    async def _final_output(self, request: Request, sink: LoopSink) -> RequestOutput:
        """The request's last output, unless its client disconnects first (ClientGone)."""
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            while True:
                nxt = asyncio.ensure_future(sink.queue.get())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    raise ClientGone
                out = nxt.result()
                if out.finished:
                    return out
        finally:
            gone.cancel()

    async def _stream(self, service: EngineService, rid: str, sink: LoopSink, req: GenerationRequest,
                      params: SamplingParams) -> AsyncIterator[str]:
        deltas = Deltas(params)
        try:
            if req.chat:  # the role first, as OpenAI's streams do
                yield sse(self._chunk(req, {"role": "assistant", "content": ""}, None, None))
            while True:
                out = await sink.queue.get()
                if out.error:  # the engine stopped under the request: say so in the stream, then end it
                    yield sse(engine_stopped(out.error).body())
                    break
                text, logprobs = deltas.advance(out)
                if text or logprobs or out.finished:
                    chunk_logprobs = self._logprobs(req, logprobs, deltas)
                    yield sse(self._chunk(req, text, chunk_logprobs, protocol.finish_reason(out)))
                if out.finished:
                    if req.include_usage:
                        yield sse({**self._envelope(req, chunk=True), "choices": [], "usage": protocol.usage(out)})
                    break
            yield sse("[DONE]")
        finally:  # the client went away (Starlette cancels the stream) or the stream ended: free the blocks now
            abort_if_open(service, rid)

    # ---- response bodies -------------------------------------------------------------------------------------
    def _envelope(self, req: GenerationRequest, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
        return {"id": req.id, "object": kind, "created": req.created, "model": self.model_name}

    def _chunk(self, req: GenerationRequest, delta: str | dict, logprobs: dict | None, finish: str | None) -> dict:
        text = {"delta": delta if isinstance(delta, dict) else {"content": delta}} if req.chat else {"text": delta}
        body = {**self._envelope(req, chunk=True), "choices": [choice(text, logprobs, finish)]}
        if req.include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last has usage null when usage was asked for
        return body

    def _logprobs(self, req: GenerationRequest, logprobs, deltas: Deltas | None = None) -> dict | None:
        if req.logprobs is None:
            return None
        if req.chat:
            return self.token_text.chat_logprobs(logprobs)
        offset = deltas.text_offset if deltas else 0
        body = self.token_text.completion_logprobs(logprobs, offset)
        if deltas:
            deltas.text_offset += sum(len(t) for t in body["tokens"])
        return body

    def _response(self, req: GenerationRequest, out: RequestOutput) -> dict:
        text = {"message": {"role": "assistant", "content": out.text}} if req.chat else {"text": out.text}
        logprobs = self._logprobs(req, out.logprobs or [])
        return {**self._envelope(req, chunk=False), "choices": [choice(text, logprobs, out.finish_reason)],
                "usage": protocol.usage(out)}


def choice(text: dict, logprobs: dict | None, finish: str | None) -> dict:
    """The one choice of a response or a chunk (this engine returns n=1), its text as the API names it."""
    return {"index": 0, **text, "logprobs": logprobs, "finish_reason": finish}


def prompt_text(req: GenerationRequest) -> str:
    """The text of a prompt as sent (a chat's message contents joined), for the checks before tokenizing."""
    if req.chat:
        return "\n".join(m["content"] for m in req.prompt)
    return req.prompt if isinstance(req.prompt, str) else ""


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def engine_stopped(reason: str) -> ApiError:
    return ApiError(503, f"the engine stopped: {reason}", "service_unavailable", code="engine_stopped")


def abort_if_open(service: EngineService, rid: str) -> None:
    if service.is_streaming(rid):
        service.abort(rid)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

