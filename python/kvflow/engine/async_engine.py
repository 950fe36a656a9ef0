"""The online engine: requests arrive at any time from many asyncio tasks, each gets an async
stream of its outputs, and one background task steps the engine while there is work.

Every call into LLMEngine (add, abort, step) runs on one worker thread, so they are serialized
without locks and the event loop stays free while a model step runs."""

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.sampling_params import SamplingParams


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-engine")
        self._streams: dict[str, asyncio.Queue] = {}
        self._has_work: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that gives it a token; the last one has
        finished=True. Raises ValueError (before yielding) for a request the engine rejects.
        Leaving the iteration early (or cancelling the task) aborts the request."""
        self._ensure_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        try:
            await self._call(self.engine.add_request, request_id, prompt, params)
        except BaseException:
            del self._streams[request_id]
            raise
        self._has_work.set()
        finished = False
        try:
            while not finished:
                output = await stream.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self._call(self.engine.abort_request, request_id)

    async def abort(self, request_id: str) -> None:
        """Ends a request and frees its blocks; its stream ends without a finished output."""
        await self._call(self.engine.abort_request, request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

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
                    self._streams.pop(request_id).put_nowait(error)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put_nowait(output)
            if not await self._call(self.engine.has_unfinished_requests):
                self._has_work.clear()
