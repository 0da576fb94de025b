"""Scale-out on Ray Serve: N replicas of the castspec server behind one OpenAI endpoint, on one machine or a cluster.

Each replica is the single server unchanged (its own engine, engine loop, torch threads and FastAPI app) run by
Serve as an ingress deployment: Serve's proxy spreads the requests over the replicas, restarts a replica that dies
and changes their number when autoscaling is on. A second, tiny deployment (the metrics board) keeps the latest
metrics of every replica, so /metrics on the one endpoint returns all of them, each series labelled with its
replica; every response names the replica that served it in an `x-castspec-replica` header.

Use it from the command line (`castspec serve ... --replicas N`) or in your own Ray application:

    from castspec.serve.ray_app import ReplicaConfig, ScaleConfig, build_application
    serve.run(build_application(ReplicaConfig({"model": "smollm2-135m", "method": "cast", "drafter": "ngram"},
                                              "smollm2-135m"), ScaleConfig(replicas=2)), route_prefix="/")
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from castspec.costs.prefill import PREFILL_AT_ONCE, PREFILL_SLACK
from castspec.errors import CastspecError

try:
    import ray
    from ray import serve
except ImportError as e:  # `castspec serve` without --replicas needs no Ray
    raise CastspecError("scaling out needs Ray Serve: pip install 'castspec[ray]'") from e

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from castspec.serve.app import Server, build_app, refreshed_registry
from castspec.serve.loop import EngineLoop, in_passing_thread
from castspec.serve.metrics import PUSH_EVERY_S, ServerMetrics

REPLICA_HEADER = "x-castspec-replica"
STALE_AFTER_S = 30.0  # a replica silent this long (dead, scaled down) leaves /metrics
CONSTRUCTOR_RETRIES = 3  # Serve's default of 20 makes a replica that cannot load take minutes to report it
# Engine.load arguments that check_options lacks
LOAD_ONLY = ("model", "dtype", "device", "prepack", "compile", "cost_table", "force_table")


@dataclass
class ReplicaConfig:
    """What every replica runs: `engine` is Engine.load's keyword arguments (model, method, drafter, ...)."""

    engine: dict
    served_model_name: str
    max_batch_size: int = 8
    max_waiting: int = 256
    threads: int = 1  # torch threads per replica
    trace: str | None = None  # each replica writes STEM.<replica id>.jsonl beside it
    prefix_cache_gb: float = 0.0  # each replica keeps its own
    prefill_chunk: int | str | None = None  # tokens, "auto" (sized by time) or None (a prompt at once)
    prefill_slack: float = PREFILL_SLACK
    prefill_at_once: float = PREFILL_AT_ONCE


@dataclass
class ScaleConfig:
    """How many replicas, what each holds, and when Serve adds or removes them."""

    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int | None = None  # default: the engine's max batch size + 1
    min_replicas: int | None = None  # both bounds given: autoscaling between them
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling target per replica; default the max batch size

    def check(self, max_batch_size: int) -> None:
        if self.replicas < 1:
            raise CastspecError(f"--replicas must be positive, got {self.replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise CastspecError("--replica-cpus and --replica-gpus must not be negative")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < max_batch_size:
            raise CastspecError(f"--max-ongoing-requests {self.max_ongoing_requests} is below --max-batch-size "
                                f"{max_batch_size}: Serve would never fill the batch")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise CastspecError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.replicas <= self.max_replicas:
            raise CastspecError(f"autoscaling needs 0 <= --min-replicas <= --replicas <= --max-replicas, got "
                                f"{self.min_replicas}, {self.replicas}, {self.max_replicas}")

    def deployment_options(self, max_batch_size: int) -> dict:
        self.check(max_batch_size)
        # Serve's default of 5 ongoing requests would cap the batch; more than a batch lets a burst pile up on one
        # replica while another idles (Serve routes on queue lengths it knows late); the one extra slot lets a
        # /metrics or /health call through to a full replica
        options = {"max_ongoing_requests": self.max_ongoing_requests or max_batch_size + 1,
                   "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
                   "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}
        if self.min_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or max_batch_size}
        return options


# -- metrics of every replica on one endpoint ------------------------------------------------------------------------

Snapshot = list[tuple[str, str, str, list[tuple[str, dict, float]]]]


def snapshot(registry: CollectorRegistry) -> Snapshot:
    """A registry's families as plain data (they travel between processes)."""
    return [(m.name, m.documentation, m.type, [(s.name, dict(s.labels), s.value) for s in m.samples])
            for m in registry.collect()]


class _Merged:
    """A Prometheus collector of several replicas' snapshots: one family per name, a `replica` label per series."""

    def __init__(self, by_replica: dict[str, Snapshot]) -> None:
        self.by_replica = by_replica

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, families_of_replica in sorted(self.by_replica.items()):
            for name, documentation, kind, samples in families_of_replica:
                family = families.setdefault(name, Metric(name, documentation, kind))
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, {**labels, "replica": replica}, value)
        yield from families.values()


def render(by_replica: dict[str, Snapshot]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(by_replica))
    return generate_latest(registry)


class MetricsBoard:
    """The latest metrics snapshot of each replica (one board per application)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, Snapshot]] = {}

    def put(self, replica: str, families: Snapshot) -> None:
        self._latest[replica] = (time.monotonic(), families)

    def collect(self) -> dict[str, Snapshot]:
        now = time.monotonic()
        self._latest = {r: (t, f) for r, (t, f) in self._latest.items() if now - t <= STALE_AFTER_S}
        return {r: f for r, (_, f) in self._latest.items()}


# -- the replica -----------------------------------------------------------------------------------------------------


class _ReplicaHeader:
    """Names the serving replica in every response's headers (pure ASGI: streams and disconnects untouched)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        return await self.app(scope, receive, send_named)


def _replica_trace(trace: str | None, replica: str) -> str | None:
    if trace is None:
        return None
    path = Path(trace)
    return str(path.with_name(f"{path.stem}.{replica}{path.suffix or '.jsonl'}"))


@serve.ingress()
class CastspecReplica:
    """One castspec server inside a Serve replica."""

    async def __init__(self, config: ReplicaConfig, board) -> None:
        import torch

        from castspec.api import Engine

        torch.set_num_threads(config.threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        # loaded in a thread that ends, so that the engine thread's OpenMP team is the only one (in_passing_thread)
        engine = await asyncio.to_thread(in_passing_thread, lambda: Engine.load(**config.engine))
        name = config.served_model_name
        stepper = engine.stepper(config.max_batch_size, config.max_waiting, config.prefix_cache_gb,
                                 config.prefill_chunk, config.prefill_slack, config.prefill_at_once)
        loop = EngineLoop(stepper, ServerMetrics(name),
                          _replica_trace(config.trace, self.replica))
        self.server = Server(loop, engine.tokenizer, name, engine.target.max_positions, config.max_waiting)
        self.board = board
        self._pusher = asyncio.get_running_loop().create_task(self._push_forever())

    async def _push(self) -> None:
        await self.board.put.remote(self.replica, snapshot(refreshed_registry(self.server)))

    async def _push_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # a board being restarted: the next push catches up
                await self._push()
            await asyncio.sleep(PUSH_EVERY_S)

    async def all_metrics(self) -> bytes:
        await self._push()
        return render(await self.board.collect.remote())

    def __serve_build_asgi_app__(self):
        app = build_app(self.server, self.all_metrics)
        app.add_middleware(_ReplicaHeader, replica=self.replica)
        return app

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine loop died is replaced."""
        if self.server.loop.error is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.server.loop.error!r}")


def build_application(config: ReplicaConfig, scale: ScaleConfig | None = None, name: str = "castspec"):
    """The Serve application: `scale.replicas` castspec replicas and their metrics board."""
    from castspec.api import Engine

    scale = scale or ScaleConfig()
    Engine.check_options(**{k: v for k, v in config.engine.items() if k not in LOAD_ONLY})
    if scale.num_gpus > 0 and config.engine.get("device", "cpu") == "cpu":
        raise CastspecError("--replica-gpus gives each replica a GPU; add --device cuda to use it")
    board = serve.deployment(MetricsBoard, name=f"{name}-metrics", num_replicas=1,
                             ray_actor_options={"num_cpus": 0}).bind()
    replicas = serve.deployment(CastspecReplica, name=name, **scale.deployment_options(config.max_batch_size))
    return replicas.bind(config, board)


def replica_actor_names(app_name: str = "castspec") -> dict[str, str]:
    """Replica id -> Ray actor name of the application's engine replicas (to inspect or kill one)."""
    prefix = f"SERVE_REPLICA::{app_name}#{app_name}#"
    return {a["name"][len(prefix):]: a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def serve_forever(config: ReplicaConfig, scale: ScaleConfig, host: str, port: int, address: str | None = None,
                  name: str = "castspec", log: Callable[[str], None] = print) -> None:
    """Runs the application on a local Ray (started here) or the cluster at `address` until SIGINT / SIGTERM;
    then removes it, and stops Ray if it was started here."""
    from castspec.models import resolve

    application = build_application(config, scale, name)  # bad options fail before Ray starts
    own_ray = address is None and not ray.is_initialized()
    if own_ray:  # replicas on this machine: fetch registry models once here, not in every replica at once
        for key in ("model", "draft"):
            if config.engine.get(key):
                resolve(config.engine[key], log=log)
    if own_ray:
        ray.init(include_dashboard=False, logging_level="warning", log_to_driver=False)
    elif not ray.is_initialized():
        try:
            ray.init(address=address, logging_level="warning", log_to_driver=False)
        except ConnectionError as e:
            raise CastspecError(f"no Ray cluster at {address!r}: {e}") from None

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application, name=name, route_prefix="/", blocking=False)
        except RuntimeError as e:  # a replica that cannot start: Serve's message ends with the reason
            raise CastspecError(f"the replicas did not start: {str(e).strip().splitlines()[-1]}") from None
        log(f"castspec: serving {config.served_model_name!r} on {len(replica_actor_names(name))} Ray Serve "
            f"replica(s) at http://{host}:{port}/v1 (Ray cluster: {ray.get_runtime_context().gcs_address})")
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(Exception):
            serve.delete(name)
        if own_ray:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
        log("castspec: stopped")

