"""The engine loop: one thread owns the StepEngine and steps it while any request is unfinished; the server's
event loop hands requests in and receives each step's outputs through per-request callbacks."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from castspec.decode.engine import RequestError, RequestOutput, RequestParams, StepEngine
from castspec.serve.malloc import HeapTrimmer
from castspec.serve.metrics import ServerMetrics
from castspec.serve.protocol import FINISH_REASONS

Sink = Callable[[RequestOutput | BaseException], None]
T = TypeVar("T")


def in_passing_thread(make: Callable[[], T]) -> T:
    """`make()` run in a thread that ends when it returns (its exception raised here). Load the engine so: a
    thread that has run torch's CPU kernels keeps an OpenMP team of worker threads, and libgomp lets workers spin
    between parallel regions only while it manages no more threads than there are CPUs. With the loading thread's
    team kept beside the engine thread's, AR decode steps (B=4, Qwen2.5-Coder-1.5B, 2-core AMD EPYC) took
    178-198 ms against 135-161 ms in the thread that loaded the model; loaded in a passing thread, the engine
    thread's team is the only one."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread as is
            box["error"] = e

    thread = threading.Thread(target=run, name="castspec-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@dataclass
class _Live:
    sink: Sink
    prompt_tokens: int
    arrived: float
    last_output: float | None = None
    first_token: float | None = None
    steps: list = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine: StepEngine, metrics: ServerMetrics, trace_path: str | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="castspec-engine", daemon=True)
        self._trace = open(trace_path, "a") if trace_path else None  # noqa: SIM115 - closed in stop()
        self._step_number = 0
        self._pending = 0  # submitted, not yet taken in by the engine thread (counts against the waiting queue)
        self._pending_lock = threading.Lock()
        self.error: BaseException | None = None
        self._heap = HeapTrimmer()

    # -- called from the server's thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            try:
                self.engine.flush_costs()
            except OSError as e:  # what was learned is lost, the shutdown is not
                print(f"castspec serve: could not save the learned cost table: {e}", flush=True)
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request_id: str, prompt_ids: list[int], params: RequestParams, sink: Sink) -> None:
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", request_id, prompt_ids, params, sink, time.perf_counter()))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def reset_prefix_cache(self, timeout: float = 60.0) -> None:
        """Empty the prefix cache between steps (the engine thread owns it); returns once it is done."""
        done = threading.Event()
        self._inbox.put(("reset", done))
        self._wake.set()
        done.wait(timeout)

    def queued(self) -> int:
        """Requests waiting for a place in the batch, including those not yet handed to the engine."""
        return self.engine.num_waiting + self._pending

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._record(outputs)
                self._heap.maybe_trim()  # freed pages inside the heap go back (serve/malloc.py)
        except BaseException as e:  # the loop is dead: every request still open learns why, /health says 503
            self.error = e
            for live in self._live.values():
                live.sink(e)
            self._live.clear()

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "abort":
                self.engine.abort(item[1])
                continue
            if item[0] == "reset":
                self.engine.prefix_cache.clear()
                item[1].set()
                continue
            _, request_id, prompt_ids, params, sink, arrived = item
            with self._pending_lock:
                self._pending -= 1
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except RequestError as e:
                sink(e)
                continue
            self._live[request_id] = _Live(sink, len(prompt_ids), arrived)

    def _record(self, outputs: list[RequestOutput]) -> None:
        now, m = time.perf_counter(), self.metrics
        for info in self.engine.step_infos:
            if info.kind == "decode":
                m.observe_step(info.batch_size, info.tree_sizes, info.accepted)
            self._write_trace(info, now)
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.new_token_ids:
                m.generation_tokens.inc(len(out.new_token_ids))
                if live.first_token is None:
                    live.first_token = now
                    m.prompt_tokens.inc(live.prompt_tokens)
                    m.ttft.observe(now - live.arrived)
                    if out.prefill_started is not None:
                        m.queue_time.observe(max(0.0, out.prefill_started - live.arrived))
                        m.prefill_time.observe(now - out.prefill_started)
                elif live.last_output is not None:
                    m.itl.observe(now - live.last_output)
                live.last_output = now
            if out.finished:
                m.e2e.observe(now - live.arrived)
                m.request_success.labels(m.model_name, FINISH_REASONS.get(out.finish_reason, "unknown")).inc()
                del self._live[out.request_id]
            live.sink(out)
        m.observe_engine(self.engine)
        m.waiting.set(self.queued())

    def _write_trace(self, info, now: float) -> None:
        self._step_number += 1
        if self._trace is None:
            return
        record = info.record
        # 'kind': prefill steps (requests joining: batch_size is how many; 'prefill_chunk' while they are still
        # prefilling) delay the running rows; 'time' (the process's perf_counter at the step() call's end) and
        # 'waiting' place them against the requests' own times
        self._trace.write(json.dumps({
            "step": self._step_number, "kind": info.kind, "time": round(now, 4), "waiting": self.queued(),
            "running": self.engine.num_running, "batch_size": info.batch_size, "prompt_tokens": info.prompt_tokens,
            "cached_tokens": info.cached_tokens,
            "tree_sizes": info.tree_sizes,
            "accepted": info.accepted, "seconds": round(info.seconds, 6),
            "layer_sizes": record.layer_sizes if record else [], "widths": record.widths if record else [],
            "verify_budget": record.verify_budget if record else 0,
            "policy": record.decisions if record else {}}, default=float) + "\n")
        self._trace.flush()
