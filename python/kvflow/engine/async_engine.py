"""The online engine: requests arrive at any time from many asyncio tasks, and each gets an async
stream of its outputs.

One engine thread owns the LLMEngine. It runs the calls the event loop sends it (add, abort,
stats) between steps, and steps without pause while any request is unfinished, handing each
step's outputs to the event loop. So calls are serialized without locks, the event loop stays
free while a model step runs, and the next step never waits for the event loop to finish
streaming the last one's tokens to the clients."""

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from kvflow.engine.config import EngineConfig
from kvflow.engine.llm_engine import LLMEngine
from kvflow.engine.outputs import RequestOutput
from kvflow.engine.sampling_params import SamplingParams

_STOP = object()


class EngineStepError(RuntimeError):
    """A model step failed; every request in flight was aborted (the server's fault, not the client's)."""


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
    def __init__(self, engine: LLMEngine | None, on_finished: Callable[[RequestOutput], None] | None = None):
        """on_finished: called (on the event loop) with each request's finished output."""
        self.engine = engine
        self.on_finished = on_finished
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: queue.Queue = queue.Queue()  # (function, args, future or None), or _STOP
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_finished: Callable[[RequestOutput], None] | None = None) -> "AsyncLLMEngine":
        """Loads the model on the engine thread, which then runs every model step: torch's
        parallel regions must all run on one thread, because once two threads own OpenMP thread
        pools, libgomp stops spinning its idle workers and every small parallel op pays a futex
        wake-up (measured here: up to 2x slower decode on two cores)."""
        self = cls(None, on_finished)
        loaded = threading.Event()
        errors: list[BaseException] = []

        def load_then_run():
            try:
                self.engine = LLMEngine(config)
            except BaseException as error:
                errors.append(error)
                return
            finally:
                loaded.set()
            self._run()

        self._thread = threading.Thread(target=load_then_run, name="kvflow-engine", daemon=True)
        self._thread.start()
        loaded.wait()
        if errors:
            self._thread = None
            raise errors[0]
        return self

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
        iterated must be ended with abort() or abort_nowait()."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.perf_counter()  # before the wait for the engine thread, which counts too
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = outputs
        try:
            await self._call(self.engine.add_request, request_id, prompt, params, arrival)
        except ValueError:
            self._streams.pop(request_id, None)
            raise
        except BaseException:  # cancelled while queued: the engine may add it after all
            self.abort_nowait(request_id)
            raise
        return RequestStream(self, request_id, self._outputs(request_id, outputs))

    async def _outputs(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await outputs.get()
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
        self._calls.put((self.engine.abort_request, (request_id,), None))

    async def abort_all(self) -> None:
        """Ends every request in flight (shutdown), in one call between two steps."""
        request_ids = list(self._streams)
        finals = await self._call(lambda: [self.engine.abort_request(r) for r in request_ids])
        for request_id, final in zip(request_ids, finals):
            stream = self._streams.pop(request_id, None)
            if stream is not None and final is not None:
                stream.put_nowait(final)

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    async def shutdown(self) -> None:
        """Stops the engine thread (after the call it is running), then the engine's other ranks."""
        if self._thread is not None:
            self._calls.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self._loop = None
        if self.engine is not None:
            self.engine.shutdown()

    # ------------------------------------------------------------------ the engine thread

    async def _call(self, function, *args):
        """Runs function(*args) on the engine thread between steps and returns its result."""
        self._ensure_started()
        future = self._loop.create_future()
        self._calls.put((function, args, future))
        return await future

    def _ensure_started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            # Wait for a call only when there is nothing to step.
            try:
                item = self._calls.get(block=not self.engine.has_unfinished_requests())
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                self._run_call(*item)
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    item = None
            if self.engine.has_unfinished_requests():
                self._step()

    def _run_call(self, function, args, future) -> None:
        try:
            result, error = function(*args), None
        except Exception as exception:
            result, error = None, exception
        if future is not None:
            self._loop.call_soon_threadsafe(self._resolve, future, result, error)

    @staticmethod
    def _resolve(future: asyncio.Future, result, error) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _step(self) -> None:
        in_flight = self.engine.unfinished_request_ids()
        try:
            outputs = self.engine.step()
        except Exception as error:  # a failed step fails the requests it held, not the server
            unfinished = set(self.engine.unfinished_request_ids())
            request_ids = [r for r in in_flight if r not in unfinished]  # those the step ended
            failure = EngineStepError(f"the engine step failed: {type(error).__name__}: {error}")
            failure.__cause__ = error
            self._loop.call_soon_threadsafe(self._fail_streams, request_ids, failure)
            return
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
            if output.finished and self.on_finished is not None:
                self.on_finished(output)

    def _fail_streams(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(error)
