"""Scale-out on Ray Serve, live: a local Ray cluster (`ray.init(num_cpus=2)`), `castspec serve --replicas 2` joined
to it (SmolLM2-135M fp32, CAST over the n-gram drafter, one CPU and one torch thread per replica), called with the
real `openai` client on 127.0.0.1. Greedy outputs equal HF greedy (which the single server is proven to equal in
test_serve), requests spread over both replicas and each replica's metrics are on the one endpoint; a replica killed
mid-run is restarted by Serve while the other's requests complete and none hangs; the server shuts down clean.
Every request loop is bounded; the cluster starts and stops inside the module."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import httpx
import openai
import pytest
import ray
from ray import serve
from synthetic import flat_costs
from test_exactness import PROMPTS

from castspec import Engine
from castspec.bench.serving import launch_server
from castspec.cli import main
from castspec.serve.ray_app import REPLICA_HEADER, ScaleConfig, replica_actor_names

MODEL = "smollm2-135m"
REQUEST_BOUND_S = 300


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be positive"),
    (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be positive"),
    (["--replicas", "2", "--replica-gpus", "1"], "add --device cuda"),
    (["--replicas", "2", "--min-replicas", "1"], "both --min-replicas and --max-replicas"),
    (["--replicas", "2", "--max-ongoing-requests", "2"], "below --max-batch-size"),
    (["--replicas", "2", "--method", "chain", "--chain-length", "0"], "chain"),
    (["--replicas", "1", "--model", "./no/such/model"], "does not exist"),
    (["--replicas", "2", "--prefill-slack", "1"], "prefill slack must be a number above 1"),
])
def test_bad_scale_flags_fail_in_one_line_before_ray_starts(capsys, monkeypatch, args, message):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for options that should have been refused")

    monkeypatch.setattr(ray, "init", no_ray)  # a check that regresses fails here instead of serving forever
    code = main(["serve", "--model", MODEL, "--drafter", "ngram", "--method", "cast", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not ray.is_initialized()  # these run first in the module: the cluster fixture has not started Ray


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def endpoint(cluster, tmp_path_factory):
    table = tmp_path_factory.mktemp("costs") / "flat.json"
    flat_costs().save(table)
    log = tmp_path_factory.mktemp("logs") / "ray-serve.log"
    # at most a batch per replica: a burst of 8 must use both (with more slots Serve may route it all to one).
    # The paper's CAST, uncalibrated: calibration brings the payoff gate, which on this synthetic table (a lookup
    # priced at 0.05 AR steps) switches the n-gram drafter off after ~20 steps without a match, and a replica
    # whose share of the burst has few matches then drafts nothing (CI, stop 44): this test is about each
    # replica's drafting being counted, so every replica must draft whenever its n-gram index matches
    args = ["--drafter", "ngram", "--method", "cast", "--cost-table", str(table), "--force-table", "--cast-mode",
            "paper", "--cast-calibration", "off", "--cost-model", "fixed", "--max-batch-size", "4",
            "--max-ongoing-requests", "4",
            "--replicas", "2", "--replica-cpus", "1", "--ray-address", "auto"]
    with launch_server(MODEL, args, log, dtype="fp32", start_timeout_s=400) as base:
        yield {"base": base, "log": log}
    # the server has exited (SIGTERM): its application is gone from the cluster, which keeps running
    assert "castspec" not in serve.status().applications, log.read_text()[-2000:]
    assert replica_actor_names() == {}


def references(smollm, smollm_reference, plans):
    model, tokenizer = smollm
    encode = Engine(model, tokenizer).encode
    return [smollm_reference(tuple(encode(prompt=p)), n) for p, n in plans]


async def one_request(c: openai.AsyncOpenAI, prompt: str, n: int, stream: bool, first_chunk: asyncio.Event | None
                      = None) -> tuple[str, list[int] | None, str | None]:
    """(replica, token ids or None, error or None): a stream cut short counts as an error, never as output."""
    replica, ids, finished = "?", [], None
    try:
        raw = await c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                           temperature=0, stream=stream)
        replica = raw.headers.get(REPLICA_HEADER, "?")
        body = raw.parse()
        if not stream:
            return replica, (body.choices[0].model_extra or {})["token_ids"], None
        async for chunk in body:
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids") or []
                finished = choice.finish_reason or finished
            if first_chunk is not None:
                first_chunk.set()
    except openai.APIError as e:
        return replica, None, f"{type(e).__name__}: {e}"
    if finished is None:
        return replica, None, "the stream ended without a finish reason"
    return replica, ids, None


def replica_counts(base: str, name: str) -> dict[str, float]:
    """A counter from /metrics summed per replica."""
    counts: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name:
            counts[series.split('replica="')[1].split('"')[0]] += float(value)
    return dict(counts)


def test_eight_concurrent_greedy_requests_spread_over_two_replicas(endpoint, smollm, smollm_reference):
    base = endpoint["base"]
    plans = [(PROMPTS[i], 12 + 2 * i) for i in range(8)]
    expected = references(smollm, smollm_reference, plans)

    async def run_all():
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S)
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(one_request(c, p, n, stream=i % 2 == 0) for i, (p, n) in enumerate(plans))), REQUEST_BOUND_S)
        finally:
            await c.close()

    results = asyncio.run(run_all())
    assert [r[2] for r in results] == [None] * 8
    assert [r[1] for r in results] == expected
    served_by = collections.Counter(r[0] for r in results)
    assert set(served_by) == set(replica_actor_names()) and len(served_by) == 2, served_by

    # each replica's own counters on the one endpoint agree with the replica headers
    deadline = time.monotonic() + 30
    while replica_counts(base, "castspec:request_success_total") != served_by and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replica_counts(base, "castspec:request_success_total") == served_by
    drafts = replica_counts(base, "castspec:spec_decode_num_drafts_total")
    assert set(drafts) == set(served_by) and all(v > 0 for v in drafts.values())
    models = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
    bad = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_killed_replica_is_restarted_and_no_request_hangs(endpoint, smollm, smollm_reference):
    base = endpoint["base"]
    plans = [(PROMPTS[(3 * i) % len(PROMPTS)], 32) for i in range(8)]
    expected = references(smollm, smollm_reference, plans)
    before = replica_actor_names()
    victim = sorted(before)[0]

    async def run_all():
        c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S)
        started = [asyncio.Event() for _ in plans]
        try:
            tasks = [asyncio.create_task(one_request(c, p, n, stream=True, first_chunk=e))
                     for (p, n), e in zip(plans, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[:4])), REQUEST_BOUND_S)
            ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S)
        finally:
            await c.close()

    results = asyncio.run(run_all())
    for (replica, ids, error), want in zip(results, expected, strict=True):
        assert (ids is None) != (error is None)
        if ids is not None:
            assert ids == want  # whatever completed is exact
        if replica not in (victim, "?"):
            assert error is None, error  # the survivor's requests are untouched
        if error is not None:
            assert error.strip() and "Traceback" not in error
    assert any(r[1] is not None for r in results)

    # Serve replaces the dead replica; the endpoint serves on it again
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = replica_actor_names()
        if len(now) == 2 and victim not in now:
            status = serve.status().applications["castspec"].deployments["castspec"]
            if status.status == "HEALTHY":
                break
        time.sleep(1.0)
    now = replica_actor_names()
    assert len(now) == 2 and victim not in now, now
    ids = [one for one in now if one not in before]
    assert len(ids) == 1
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S)
    seen = set()
    for prompt, n in plans[:4]:
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
        seen.add(raw.headers[REPLICA_HEADER])
        assert (raw.parse().choices[0].model_extra or {})["token_ids"] == expected[plans.index((prompt, n))]
    assert seen <= set(now)


def test_scale_options_are_checked_before_ray_starts():
    for bad, message in [(ScaleConfig(replicas=0), "--replicas"), (ScaleConfig(max_ongoing_requests=2), "below"),
                         (ScaleConfig(min_replicas=1), "both"),
                         (ScaleConfig(replicas=3, min_replicas=1, max_replicas=2), "<= --max-replicas")]:
        with pytest.raises(Exception, match=message):
            bad.deployment_options(max_batch_size=4)
    options = ScaleConfig(replicas=2, min_replicas=1, max_replicas=4).deployment_options(max_batch_size=8)
    assert options["max_ongoing_requests"] == 9 and "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4,
                                             "target_ongoing_requests": 8}
