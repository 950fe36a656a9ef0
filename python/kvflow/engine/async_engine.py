"""The online engine: requests arrive at any time from many asyncio tasks, each gets an async
stream of its outputs, and one background task steps the engine while there is work.

Every call into LLMEngine (add, abort, step) runs on one worker thread, so they are serialized
without locks and the event loop stays free while a model step runs."""

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.sampling_params import SamplingParams


class RequestStream:
    """One request's outputs as an async iterator; abort_nowait() ends the request."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, outputs: AsyncIterator[RequestOutput]):
        self.request_id = request_id
        self._engine = engine
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs

    def abort_nowait(self) -> None:
        self._engine.abort_nowait(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None):
        """on_finished: called (on the event loop) with each request's finished output."""
        self.engine = engine
        self.on_finished = on_finished
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-engine")
        self._streams: dict[str, asyncio.Queue] = {}
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that gives it a token; the last one has
        finished=True. Raises ValueError (before yielding) for a request the engine rejects.
        Leaving the iteration early (or cancelling the task) aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        async for output in stream:
            yield output

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams | None = None) -> RequestStream:
        """Queues the request now (ValueError if the engine rejects it) and returns the stream of
        its outputs. Closing the stream before its end aborts the request; a stream never
        iterated must be ended with abort()."""
        self._ensure_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        try:
            await self._call(self.engine.add_request, request_id, prompt, params)
        except BaseException:
            del self._streams[request_id]
            raise
        self._has_work.set()
        return RequestStream(self, request_id, self._outputs(request_id, queue))

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort_nowait(request_id)
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Ends a request and frees its blocks; its stream ends with an output whose unfinished
        samples have finish_reason "abort"."""
        final = await self._call(self.engine.abort_request, request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and final is not None:
            stream.put_nowait(final)

    def abort_nowait(self, request_id: str) -> None:
        """Ends a request without waiting: for cleanup code that may itself be cancelled (a
        server's cancel scope cancels every later await). A finished or unknown id is ignored."""
        self._streams.pop(request_id, None)
        self._worker.submit(self.engine.abort_request, request_id)

    async def abort_all(self) -> None:
        """Ends every request in flight (shutdown)."""
        for request_id in list(self._streams):
            await self.abort(request_id)

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._worker.shutdown(wait=True)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._has_work = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def _step_loop(self) -> None:
        while True:
            await self._has_work.wait()
            try:
                outputs = await self._call(self.engine.step)
            except Exception as error:  # a failed step fails every request it held, not the server
                for request_id in list(self._streams):
                    await self._call(self.engine.abort_request, request_id)
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put_nowait(error)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)
                if output.finished and self.on_finished is not None:
                    self.on_finished(output)
            if not await self._call(self.engine.has_unfinished_requests):
                self._has_work.clear()
