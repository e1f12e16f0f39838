"""Search-R1's retrieval HTTP API over any Retriever (FastAPI); `retrieve.py serve` runs it.

    app = make_app(retriever)      # POST /retrieve, GET /health, GET /openapi.json, GET /docs
    serve(retriever, host="127.0.0.1", port=8000)

`POST /retrieve` takes `{"queries": [...], "topk": 3, "return_scores": true}` and answers
`{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`, one list per query,
best first; without `return_scores` the lists hold bare documents, as Search-R1's server
answers. Search-R1's client and searchlite's HTTPRetriever both work against it.

Requests are validated against the schema served at /openapi.json: at most `max_queries`
queries, `topk` 0..100, unknown fields ignored; anything else is answered 422 with a one-line
`detail` naming the field, or `body` for one that is not JSON (400 for a body that is not
UTF-8, 413 for one over `max_body_bytes`, 411 for one sent without a Content-Length). Concurrent requests are batched:
one loop takes every request that arrives within `batch_wait` seconds of the first (up to
`max_batch` queries), runs a single `retriever.search` over all their queries, once per topk
among them, in a worker thread, and hands each request its share; that is one encoder pass
and one FAISS search instead of one per request. A batch whose search fails is searched again
request by request, so that only the request at fault is answered 500; a batcher that fails
answers the requests it holds 500, never leaves them waiting. The answer is turned into JSON in a worker
thread too, so a large one does not stall other requests; a NaN or infinite score, which JSON
cannot hold, is answered 500 as well. Left out on purpose:
authentication and TLS; the server binds 127.0.0.1 unless told otherwise.

Where it differs from Search-R1's server (search_r1/search/retrieval_server.py):
- `document` is `{"id", "contents"}` only, rebuilt from the parsed passage: `id` is always a
  string (a corpus line without one gets its line index) and `contents` is `"Title"\\nText`;
  a corpus record whose `contents` lacks that form (no title line, an unquoted title) comes
  back in that form. Search-R1 answers the corpus record as stored, every field of it.
- A query longer than `max_query_chars` is cut to that many characters (Search-R1 takes any
  length); more than `max_queries` queries a request is a 422 (Search-R1 has no bound).
- `topk` must be a JSON integer (3 or 3.0; Search-R1's pydantic also takes "3" and true), and
  `return_scores` a JSON boolean (Search-R1's also takes "true" and 1): the served schema holds;
  a missing, null or 0 topk gets `default_topk`, as Search-R1's `if not request.topk` does.
- Errors are one-line strings in `detail` (FastAPI's default, which Search-R1 keeps, is a
  list of objects), and a request must carry a Content-Length (Search-R1 takes chunked ones).
"""


import asyncio
import json
import logging
from contextlib import asynccontextmanager

import uvicorn  # here, not in serve(): retrieve.py imports this module to check both before the index loads
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from searchlite.data import Passage
from searchlite.retrieval import HTTP_QUERY_CHARS

MAX_TOPK = 100


class Document(BaseModel):
    id: str
    contents: str = Field(description='Search-R1 wiki-18 form: "\\"Title\\"\\nText"')


class ScoredDocument(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredDocument] | list[Document]] = Field(description="one list per query, best first")


class ErrorResponse(BaseModel):
    detail: str


class Health(BaseModel):
    status: str
    passages: int | None


class Batcher:
    """Queues (queries, k) jobs from request handlers; `run` answers them in merged batches of
    at most `max_batch` queries (a single larger job runs alone).

    The queue and the task serve one event loop: an asyncio.Queue works only on the loop it was
    first used on, so `start` on another loop (the app served again: a second TestClient, a
    restarted server) gives that loop a fresh queue and task. If `run` stops (an error, a
    cancel), every request it holds gets the error instead of waiting forever, and the next
    request starts it again."""

    def __init__(self, retriever, wait: float, max_batch: int):
        self.retriever, self.wait, self.max_batch = retriever, wait, max_batch
        self.queue: asyncio.Queue | None = None  # made by `start`, for the loop it serves
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Start `run` on the running event loop unless it is running there already."""
        loop = asyncio.get_running_loop()
        if self.task is not None and not self.task.done() and self.task.get_loop() is loop:
            return
        if self.task is None or self.task.get_loop() is not loop:
            self.queue = asyncio.Queue()  # the old loop's task keeps its own queue
        self.task = loop.create_task(self.run())
        self.task.add_done_callback(_log_failure)

    def stop(self) -> None:
        """Cancel `run` if it runs on this loop (a lifespan's shutdown)."""
        if self.task is not None and self.task.get_loop() is asyncio.get_running_loop():
            self.task.cancel()

    async def search(self, queries: list[str], k: int) -> list:
        self.start()  # an app mounted inside another one never sees its own lifespan start
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, k, fut))
        return await fut

    async def run(self) -> None:
        queue = self.queue
        jobs, pending = [], None  # pending: a job that did not fit in the last batch; it leads the next (FIFO)
        try:
            while True:
                jobs, pending = [await queue.get() if pending is None else pending], None
                await asyncio.sleep(self.wait)  # let concurrent requests join this batch
                pending = self._fill(queue, jobs)
                by_k: dict[int, list] = {}  # one search per topk: the best 5 cut to 3 need not be the best 3 (ties)
                for job in jobs:
                    by_k.setdefault(job[1], []).append(job)
                for k, group in by_k.items():
                    try:
                        await self._answer(group, k)
                    except Exception as e:  # answer every waiting request, keep serving
                        if len(group) == 1:
                            _fail(group, e)
                            continue
                        for job in group:  # one request's queries failed the batch: each alone, so that
                            try:  # only that request gets the error
                                await self._answer([job], k)
                            except Exception as e1:
                                _fail([job], e1)
                jobs = []
        except BaseException as e:  # stopped (an error, a cancel): no request it holds may wait forever
            held = jobs + ([pending] if pending is not None else [])
            while not queue.empty():
                held.append(queue.get_nowait())
            _fail(held, e if isinstance(e, Exception) else RuntimeError("the search batcher was stopped"))
            raise

    async def _answer(self, group: list, k: int) -> None:
        """One search for every query of `group`'s requests; each request gets its own slice."""
        queries = [q for qs, _, _ in group for q in qs]
        hits = await asyncio.get_running_loop().run_in_executor(None, self.retriever.search, queries, k)
        start = 0
        for qs, _, fut in group:
            if not fut.done():  # a client that went away leaves a cancelled future
                fut.set_result(hits[start:start + len(qs)])
            start += len(qs)

    def _fill(self, queue: asyncio.Queue, jobs: list):
        """Add queued jobs to `jobs`, in arrival order, while they fit in `max_batch` queries;
        return the first that does not (it leads the next batch), or None."""
        size = sum(len(qs) for qs, _, _ in jobs)
        while not queue.empty():
            job = queue.get_nowait()
            if size + len(job[0]) > self.max_batch:
                return job
            jobs.append(job)
            size += len(job[0])
        return None


def _fail(jobs: list, e: BaseException) -> None:
    for *_, fut in jobs:
        if not fut.done():
            fut.set_exception(e)


def _log_failure(task: asyncio.Task) -> None:
    """Report a batcher that died of an error once, here (its requests got the error): unread, asyncio
    would print "Task exception was never retrieved" when the task is collected."""
    if not task.cancelled() and task.exception() is not None:
        logging.getLogger(__name__).error("the search batcher stopped; the next request restarts it",
                                          exc_info=task.exception())


def _document(h) -> dict:
    return {"id": h.id, "contents": Passage(h.id, h.title, h.text).contents}


def _answer(found: list, return_scores: bool) -> bytes:
    """The JSON body of an answer, written as Starlette's JSONResponse writes it. Built by hand:
    validating 10^5 hits against RetrieveResponse is slow."""
    if return_scores:
        result = [[{"document": _document(h), "score": h.score} for h in hits] for hits in found]
    else:
        result = [[_document(h) for h in hits] for hits in found]
    return json.dumps({"result": result}, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def make_app(retriever, *, default_topk: int = 3, max_queries: int = 4096, max_query_chars: int = HTTP_QUERY_CHARS,
             max_body_bytes: int = 64 << 20, batch_wait: float = 0.005, max_batch: int = 4096) -> FastAPI:
    """The FastAPI app serving `retriever` with these request bounds and batching settings;
    `default_topk` answers a request that sends no topk, null or 0."""
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"default_topk must be 1..{MAX_TOPK}, got {default_topk}")

    class RetrieveRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")  # Search-R1's clients may send more fields
        queries: list[str] = Field(max_length=max_queries, description=f"at most {max_queries} queries; one over "
                                   f"{max_query_chars} characters is cut to its first {max_query_chars}")
        topk: int | None = Field(None, ge=0, le=MAX_TOPK, description="passages per query; missing, null or 0: "
                                 f"the server's default ({default_topk}), as Search-R1's server does")
        return_scores: bool = Field(False, strict=True, description="wrap each document with its score (a JSON "
                                    "boolean, as the schema says: not 1 or \"true\")")

        @field_validator("topk", mode="before")
        @classmethod
        def json_integer(cls, v):
            """A JSON Schema integer or null: 3 or 3.0, not "3", true, NaN or Infinity."""
            if isinstance(v, float) and v.is_integer():  # False for NaN and Infinity
                v = int(v)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError("Input should be a valid integer")
            return v

    batcher = Batcher(retriever, batch_wait, max_batch)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()  # this loop's queue and task: an app may be served on several loops in turn
        yield
        batcher.stop()

    app = FastAPI(title="searchlite retrieval", version="1", lifespan=lifespan,
                  description="Search-R1-compatible retrieval: POST /retrieve")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        msgs = []
        for e in exc.errors():
            field = ".".join(str(x) for x in e["loc"][1:])
            if e.get("type") == "json_invalid":  # not JSON: its loc is ("body", a character position)
                why = (e.get("ctx") or {}).get("error") or e["msg"]
                msgs.append(f"body: not valid JSON ({why} at character {field}; send a JSON object)")
            elif field:
                msgs.append(f"{field}: {e['msg']}")
            else:  # the body as a whole: not a JSON object, or none
                msgs.append(f"body: {e['msg']} (send a JSON object with Content-Type: application/json)")
        return JSONResponse({"detail": "; ".join(msgs)}, status_code=422)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        # A chunked body announces no size, so it could not be held to max_body_bytes: refuse it
        # (Search-R1's client, requests with json=, and HTTPRetriever always send a Content-Length).
        if "transfer-encoding" in request.headers or (request.method == "POST" and size is None):
            return JSONResponse({"detail": "a Content-Length header is required (no chunked bodies)"},
                                status_code=411)
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return JSONResponse({"detail": f"request body over {max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    errors = {code: {"model": ErrorResponse} for code in (400, 411, 413, 422, 500)}

    @app.post("/retrieve", response_model=RetrieveResponse, responses=errors)
    async def retrieve(req: RetrieveRequest):
        queries = [q[:max_query_chars] for q in req.queries]  # cut, not refused: Search-R1's client has no limit
        try:
            found = await batcher.search(queries, req.topk or default_topk) if queries else []
        except Exception as e:
            return JSONResponse({"detail": f"search failed: {type(e).__name__}: {e}"}, status_code=500)
        # In a worker thread: a 57 MB answer took 2 s to write, and on the event loop it held up every request.
        try:
            body = await asyncio.get_running_loop().run_in_executor(None, _answer, found, req.return_scores)
        except ValueError:  # json.dumps(allow_nan=False): a score JSON cannot hold
            return JSONResponse({"detail": "search failed: a passage's score is NaN or infinite"}, status_code=500)
        return Response(content=body, media_type="application/json")

    @app.get("/health", response_model=Health)
    async def health():
        passages = getattr(retriever, "passages", None)
        return {"status": "ok", "passages": None if passages is None else len(passages)}

    return app


def serve(retriever, host: str = "127.0.0.1", port: int = 8000, **settings) -> None:
    """Run the app with uvicorn until interrupted; `settings` go to make_app."""
    uvicorn.run(make_app(retriever, **settings), host=host, port=port, access_log=False)


if __name__ == "__main__":
    import sys

    sys.exit("the server runs from retrieve.py: python retrieve.py serve --help")
