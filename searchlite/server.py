"""Search-R1's retrieval HTTP API over any Retriever (FastAPI); `retrieve.py serve` runs it.

    app = make_app(retriever)      # POST /retrieve, GET /health, GET /openapi.json, GET /docs
    serve(retriever, host="127.0.0.1", port=8000)

`POST /retrieve` takes `{"queries": [...], "topk": 3, "return_scores": true}` and answers
`{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`, one list per query,
best first; without `return_scores` the lists hold bare documents, as Search-R1's server
answers. Search-R1's client and searchlite's HTTPRetriever both work against it.

Requests are validated against the schema served at /openapi.json: `topk` 1..100, at most
`max_queries` queries of at most `max_query_chars` characters each, unknown fields ignored;
anything else is answered 422 with a one-line `detail` naming the field (400 for a body that
is not UTF-8, 413 for one over `max_body_bytes`). Concurrent requests are batched: one loop takes every request that
arrives within `batch_wait` seconds of the first (up to `max_batch` queries), runs a single
`retriever.search` over all their queries with the largest topk among them, in a worker
thread, and hands each request its share; that is one encoder pass and one FAISS search
instead of one per request. Left out on purpose: authentication and TLS; the server binds
127.0.0.1 unless told otherwise.
"""


import asyncio
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

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
    """Queues (queries, k) jobs from request handlers; `run` answers them in merged batches."""

    def __init__(self, retriever, wait: float, max_batch: int):
        self.retriever, self.wait, self.max_batch = retriever, wait, max_batch
        self.queue: asyncio.Queue = asyncio.Queue()

    async def search(self, queries: list[str], k: int) -> list:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((queries, k, fut))
        return await fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            await asyncio.sleep(self.wait)  # let concurrent requests join this batch
            size = len(jobs[0][0])
            while size < self.max_batch and not self.queue.empty():
                jobs.append(self.queue.get_nowait())
                size += len(jobs[-1][0])
            by_k: dict[int, list] = {}  # one search per topk: the best 5 cut to 3 need not be the best 3 (ties)
            for job in jobs:
                by_k.setdefault(job[1], []).append(job)
            for k, group in by_k.items():
                queries = [q for qs, _, _ in group for q in qs]
                try:
                    hits = await loop.run_in_executor(None, self.retriever.search, queries, k)
                except Exception as e:  # answer every waiting request, keep serving
                    for *_, fut in group:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                start = 0
                for qs, _, fut in group:
                    if not fut.done():  # a client that went away leaves a cancelled future
                        fut.set_result(hits[start:start + len(qs)])
                    start += len(qs)


def _document(h) -> dict:
    return {"id": h.id, "contents": Passage(h.id, h.title, h.text).contents}


def make_app(retriever, *, max_queries: int = 4096, max_query_chars: int = HTTP_QUERY_CHARS,
             max_body_bytes: int = 64 << 20, batch_wait: float = 0.005, max_batch: int = 4096) -> FastAPI:
    """The FastAPI app serving `retriever` with these request bounds and batching settings."""

    class RetrieveRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")  # Search-R1's clients may send more fields
        queries: list[Annotated[str, StringConstraints(max_length=max_query_chars)]] = Field(
            max_length=max_queries, description=f"at most {max_queries} queries of at most {max_query_chars} characters")
        topk: int = Field(3, ge=1, le=MAX_TOPK, description="passages per query")
        return_scores: bool = Field(False, strict=True, description="wrap each document with its score")

        @field_validator("topk", mode="before")
        @classmethod
        def json_integer(cls, v):
            """A JSON Schema integer: 3 or 3.0, not "3" or true (pydantic's lax mode takes those)."""
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise ValueError("Input should be a valid integer")
            return int(v)

    batcher = Batcher(retriever, batch_wait, max_batch)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="searchlite retrieval", version="1", lifespan=lifespan,
                  description="Search-R1-compatible retrieval: POST /retrieve")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(msgs)}, status_code=422)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > max_body_bytes:
            return JSONResponse({"detail": f"request body over {max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    errors = {code: {"model": ErrorResponse} for code in (400, 413, 422, 500)}

    @app.post("/retrieve", response_model=RetrieveResponse, responses=errors)
    async def retrieve(req: RetrieveRequest):
        try:
            found = await batcher.search(req.queries, req.topk) if req.queries else []
        except Exception as e:
            return JSONResponse({"detail": f"search failed: {type(e).__name__}: {e}"}, status_code=500)
        if req.return_scores:
            result = [[{"document": _document(h), "score": h.score} for h in hits] for hits in found]
        else:
            result = [[_document(h) for h in hits] for hits in found]
        return JSONResponse({"result": result})  # built by hand: validating 10^5 hits per answer is slow

    @app.get("/health", response_model=Health)
    async def health():
        passages = getattr(retriever, "passages", None)
        return {"status": "ok", "passages": None if passages is None else len(passages)}

    return app


def serve(retriever, host: str = "127.0.0.1", port: int = 8000, **limits) -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(make_app(retriever, **limits), host=host, port=port, access_log=False)
