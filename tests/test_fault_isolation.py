"""A fault belongs to the request that caused it: each defect reproduced against a real
``pyagent serve`` process on the embedded SmolLM2 (a misbehaving plugin installed as a
distribution beside it), then the same server serves the next request; a chaos run of
mixed traffic; and an engine that cannot go on (its forward raises, or hangs past the
watchdog) answers 503 and exits non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from pyagent_framework.server.process import server_process
from tests import faulty_plugin
from tests.tiny_models import tiny_checkpoint

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    return str(faulty_plugin.install(tmp_path_factory.mktemp("faulty")))


@pytest.fixture(scope="module")
def server(plugin_path):
    flags = (
        "--trust-request-chat-template",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "faulty",
        "--max-num-seqs", "32",
        "--grammar-compile-timeout", "5",
    )
    with server_process(*flags, env={"PYTHONPATH": plugin_path}) as s:
        s.idle_blocks = s.metric("pyagent:num_free_kv_blocks")
        yield s


def settled(server, timeout: float = 60.0) -> None:
    """Running and waiting back at 0 and every KV block free again."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (
            server.metric("pyagent:num_requests_running") == 0
            and server.metric("pyagent:num_requests_waiting") == 0
            and server.metric("pyagent:num_free_kv_blocks") == server.idle_blocks
        ):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"not settled: running {server.metric('pyagent:num_requests_running')}, waiting "
        f"{server.metric('pyagent:num_requests_waiting')}, free blocks {server.metric('pyagent:num_free_kv_blocks')} "
        f"of {server.idle_blocks}"
    )


def still_serves(server) -> None:
    assert server.get("/health")[0] == 200
    status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 12, "temperature": 0})
    assert status == 200 and "Paris" in answer["choices"][0]["message"]["content"], answer
    settled(server)


def events(server, path: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed response (a status other than 200 raises)."""
    return server.stream(path, body)


def rss_kib(server) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ---------------------------------------------------------------------- lifecycle


def test_clients_that_give_up_while_admitted_do_not_kill_the_engine(server):
    """A long prompt is in prefill; clients with a 0.3 s timeout send short requests
    and give up while their adds wait for the engine thread."""
    long_prompt = "Tell me about the history of the city. " * 180  # ~1,500 tokens: a second or more of prefill

    async def give_up(http, i: int) -> str:
        try:
            await http.post("/v1/completions", json={"prompt": f"Short {i}", "max_tokens": 64}, timeout=0.3)
        except httpx.TimeoutException:
            return "gave up"
        return "answered"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            for round_ in range(3):
                long = asyncio.ensure_future(
                    http.post("/v1/completions", json={"prompt": long_prompt + str(round_), "max_tokens": 4})
                )
                await asyncio.sleep(0.1)
                results = await asyncio.gather(*(give_up(http, 10 * round_ + i) for i in range(6)))
                assert "gave up" in results
                assert (await long).status_code == 200

    asyncio.run(main())
    still_serves(server)


# ---------------------------------------------------------------------- plugins that raise


def test_a_grammar_matcher_that_raises_fails_only_its_request(server):
    calm = {"messages": QUESTION, "max_tokens": 12, "temperature": 0}
    faulty = {"messages": QUESTION, "max_tokens": 12, "structured_outputs": {"regex": "[A-Z][a-z]+", "backend": "faulty"}}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        expected = client.post("/v1/chat/completions", json=calm).json()["choices"][0]["message"]["content"]
        results = {}

        def run(name, body):
            results[name] = client.post("/v1/chat/completions", json=body)

        threads = [threading.Thread(target=run, args=(i, calm if i % 2 else faulty)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, response in results.items():
        if i % 2:
            assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == expected
        else:
            error = response.json()["error"]
            assert response.status_code == 500 and error["type"] == "server_error", error
            assert "grammar_backend 'faulty'" in error["message"] and "accept_tokens" in error["message"]
            assert "pyagent-faulty-test" in error["message"]  # the distribution that registered it
    # Streamed: an error event, then [DONE].
    data = events(server, "/v1/chat/completions", faulty)
    assert data[-1] == "[DONE]" and "accept_tokens" in json.loads(data[-2])["error"]["message"]
    # A 500 keeps its keep-alive connection: the next request goes on the same one.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    for body, status in ((faulty, 500), (calm, 200)):
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == status and not response.will_close
    connection.close()
    still_serves(server)


def test_a_tool_parser_that_raises_ends_the_stream_with_an_error_then_done(server):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 16, "temperature": 0}
    data = events(server, "/v1/chat/completions", body)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert "tool_parser 'faulty'" in error["message"] and "extract_streaming" in error["message"]
    status, answer = server.post_json("/v1/chat/completions", body)
    assert status == 500 and "tool_parser 'faulty'" in answer["error"]["message"]
    still_serves(server)


def test_a_tool_parser_failure_names_kind_entry_distribution_and_method(server):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 16, "temperature": 0}
    status, answer = server.post_json("/v1/chat/completions", body)
    assert status == 500
    assert answer["error"]["message"] == (
        "tool_parser 'faulty' (pyagent-faulty-test 0.0.1) raised in extract(): "
        "ValueError: faulty tool parser: extract always fails"
    )


def test_an_eviction_policy_that_raises_is_replaced_by_lru_and_the_server_goes_on(plugin_path, tmp_path_factory):
    """The policy serves the whole engine: its failure is logged once, by name, the
    built-in 'lru' takes over (as /metrics says), and every request is answered."""
    path = tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))
    flags = ("--model", path, "--max-model-len", "128", "--num-kv-blocks", "24", "--block-size", "16",
             "--eviction-policy", "faulty", "--max-num-seqs", "2")
    with server_process(*flags, env={"PYTHONPATH": plugin_path}) as server:
        def policy_in_use() -> set[tuple[str, str]]:
            _, text = server.get("/metrics")
            found = set()
            for labels in re.findall(r"^pyagent:entry_info\{(.*)\} 1\.0$", text, re.M):
                label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                if label["kind"] == "eviction_policy":
                    found.add((label["name"], label["distribution"]))
            return found

        assert policy_in_use() == {("faulty", "pyagent-faulty-test")}
        # Distinct prompts fill the cache with filed blocks, so allocations must evict.
        for i in range(24):
            body = {"prompt": f"request {i}: " + "the quick brown fox " * 6, "max_tokens": 8, "ignore_eos": True}
            status, answer = server.post_json("/v1/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["finish_reason"] == "length"
        assert policy_in_use() == {("lru", "pyagent-framework")}
        assert server.get("/health")[0] == 200
        failures = [line for line in server.log_text().splitlines() if "raised in evict()" in line]
        assert len(failures) == 1, failures
        assert ("eviction_policy 'faulty' (pyagent-faulty-test 0.0.1) raised in evict(): "
                "RuntimeError: faulty eviction policy: evict always fails") in failures[0]
        assert "built-in 'lru'" in failures[0]


# ---------------------------------------------------------------------- bounded work


def test_a_pattern_whose_matching_cost_grows_without_bound_is_refused_at_once(server):
    started = time.time()
    status, answer = server.post_json(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "(.*){1,32000}[bc]"}}
    )
    assert status == 400 and "(.*){1,32000}" in answer["error"]["message"], answer
    assert answer["error"]["param"].startswith("structured_outputs")
    assert time.time() - started < 5
    still_serves(server)


def test_a_compile_past_its_timeout_is_stopped_not_left_burning_cpu(server):
    # About 4 s of compiling and 8 s of serializing on SmolLM2's vocabulary: past the 5 s limit.
    regex = "".join(f"[a-{chr(ord('z') - i)}0-9]{{1,2000}}" for i in range(8))
    status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": regex}})
    assert status == 400 and "5 s limit" in answer["error"]["message"], answer
    time.sleep(0.5)
    before = cpu_seconds(server.process.pid)
    time.sleep(2.0)
    assert cpu_seconds(server.process.pid) - before < 0.5  # idle: nothing compiles on
    still_serves(server)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live children (the grammar workers)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [pid, *map(int, children)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def test_a_grammar_over_its_per_token_budget_fails_its_request_and_metrics_stay_live(server):
    # A grammar (no static rules there) whose matching costs 0.3-1.4 s a token on this
    # machine, and more as it goes: the per-token budget (grammar_token_timeout, 0.25 s) ends it.
    body = {"messages": QUESTION, "max_tokens": 40, "structured_outputs": {"grammar": 'root ::= ([a-z]+ " "?){1,30}'}}
    result = {}
    thread = threading.Thread(target=lambda: result.update(answer=server.post_json("/v1/chat/completions", body)))
    thread.start()
    while thread.is_alive():
        started = time.time()
        assert server.get("/metrics")[0] == 200
        assert time.time() - started < 3  # /metrics never waits on a slow step
        time.sleep(0.2)
    status, answer = result["answer"]
    assert status == 400 and "grammar_token_timeout" in answer["error"]["message"], answer
    still_serves(server)


def test_template_bombs_are_400s_and_the_server_stays_small(server):
    before = rss_kib(server)
    for template, words in (
        ("{{ 'a' * 10**9 }}", "chat template"),
        ("{% for i in range(10**9) %}x{% endfor %}", "chat template"),
    ):
        started = time.time()
        status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, "chat_template": template})
        assert status == 400 and words in answer["error"]["message"], answer
        assert time.time() - started < 10
    assert rss_kib(server) - before < 300 * 1024  # not the 22 GB it took
    # A template that loops until its time limit holds a worker thread, not the event
    # loop: the server answers others meanwhile.
    spin = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    result = {}
    body = {"messages": QUESTION, "max_tokens": 4, "chat_template": spin}
    thread = threading.Thread(target=lambda: result.update(answer=server.post_json("/v1/chat/completions", body)))
    thread.start()
    time.sleep(0.3)
    started = time.time()
    assert server.get("/health")[0] == 200 and time.time() - started < 0.5
    thread.join()
    status, answer = result["answer"]
    assert status == 400 and "longer than" in answer["error"]["message"], answer
    still_serves(server)


# ---------------------------------------------------------------------- input hygiene


def test_lone_surrogates_are_400s_on_a_connection_that_stays_open(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    bodies = [
        ("/v1/completions", '{"prompt": "Hello \\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi \\udfff"}], "max_tokens": 2}', "messages.0.content"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ]
    for path, body, param in bodies:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 400 and answer["error"]["param"] == param, answer
        assert "lone surrogate" in answer["error"]["message"]
    # The same keep-alive connection goes on.
    connection.request("POST", "/tokenize", body='{"prompt": "Hello"}', headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and json.loads(response.read())["count"] >= 1
    connection.close()
    still_serves(server)


def test_vllm_fields_are_implemented_or_refused(server):
    status, answer = server.post_json("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200
    prompt_lps = answer["choices"][0]["prompt_logprobs"]
    _, tokens = server.post_json("/tokenize", {"prompt": "The capital of France is"})
    assert len(prompt_lps) == tokens["count"] and prompt_lps[0] is None
    for token, entry in zip(tokens["tokens"][1:], prompt_lps[1:]):
        assert str(token) in entry and all(v["logprob"] <= 0 for v in entry.values()) and len(entry) <= 3
    status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and answer["prompt_logprobs"][0] is None and len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"]
    for field, value in (("use_beam_search", True), ("length_penalty", 0.5)):
        status, answer = server.post_json("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, field: value})
        assert status == 400 and answer["error"]["param"] == field and field in answer["error"]["message"], answer
    # bad_words and allowed_token_ids are served (tests/test_token_control.py checks them against transformers).
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
    plain = server.post_json("/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    assert "Paris" in plain
    status, answer = server.post_json("/v1/chat/completions", {**body, "bad_words": ["Paris"]})
    assert status == 200 and "Paris" not in answer["choices"][0]["message"]["content"]
    allowed = server.post_json("/tokenize", {"prompt": " Lyon Lyon", "add_special_tokens": False})[1]["tokens"]
    status, answer = server.post_json("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                                                          "allowed_token_ids": allowed})
    assert status == 200 and answer["choices"][0]["text"].strip() and set(answer["choices"][0]["text"].split()) <= {"Lyon"}
    status, answer = server.post_json("/v1/completions", {"prompt": "x", "max_tokens": 2, "allowed_token_ids": [10**9]})
    assert status == 400 and answer["error"]["param"] == "allowed_token_ids"
    status, answer = server.post_json(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "guided_choice": ["Paris", "Lyon"]}
    )
    assert status == 200 and answer["choices"][0]["message"]["content"] in ("Paris", "Lyon")
    plain = server.post_json("/tokenize", {"messages": QUESTION})[1]["count"]
    templated = server.post_json("/tokenize", {"messages": QUESTION, "chat_template": "{{ messages[0]['content'] }}"})[1]["count"]
    assert templated < plain  # the request's template took effect


def test_models_shows_no_path_and_a_405_says_allow(server):
    status, text = server.get("/v1/models")
    assert status == 200 and "/" not in json.loads(text)["data"][0]["root"]
    assert ".gguf" not in text and "site-packages" not in text
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/v1/chat/completions")
    response = connection.getresponse()
    response.read()
    assert response.status == 405 and response.getheader("Allow") == "POST"


def test_tool_call_history_with_null_content_renders_with_the_models_own_template(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    status, answer = server.post_json("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    assert status == 200, answer


# ---------------------------------------------------------------------- chaos


def test_chaos_mixed_traffic_leaves_the_engine_as_it_found_it(server):
    """About a minute of mixed traffic: normal and streamed requests, clients that hang
    up at random points, pathological patterns, a plugin that raises, invalid Unicode.
    Every normal request gets the same greedy text as on a quiet server; afterwards
    nothing runs or waits, every KV block is free and no thread is left over."""
    prompts = [f"Write one sentence about the number {i}." for i in range(6)]
    quiet = {}
    for prompt in prompts:
        status, answer = server.post_json("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0})
        quiet[prompt] = answer["choices"][0]["text"]
    threads_before = server_threads(server)
    rng = random.Random(20)
    failures: list[str] = []

    async def normal(http, prompt):
        response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
        if response.status_code != 200 or response.json()["choices"][0]["text"] != quiet[prompt]:
            failures.append(f"normal {prompt!r}: {response.status_code} {response.text[:200]}")

    async def streamed(http, prompt):
        text = []
        async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text.extend(c["text"] for c in json.loads(line[6:])["choices"])
        if "".join(text) != quiet[prompt]:
            failures.append(f"streamed {prompt!r}: {''.join(text)!r}")

    async def hang_up(http, prompt):
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": rng.random() < 0.5}

        async def read() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        try:  # the client gives up at a random point: queued, in prefill, mid-stream
            await asyncio.wait_for(read(), rng.uniform(0.01, 1.5))
        except asyncio.TimeoutError:
            pass

    async def refused(http, body, status):
        # json.dumps escapes a lone surrogate as \\ud800, as a client's JSON would.
        response = await http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
        if response.status_code != status:
            failures.append(f"expected {status} for {body}: {response.status_code} {response.text[:200]}")

    bad = [
        ({"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "(\\w+\\s?){1,500}"}}, 400),
        ({"messages": QUESTION, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]+", "backend": "faulty"}}, 500),
        ({"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 8}, 400),
        ({"messages": QUESTION, "max_tokens": 8, "tools": TOOLS}, 500),
        ({"messages": QUESTION, "max_tokens": 8, "chat_template": "{{ 'a' * 10**9 }}"}, 400),
    ]

    async def main():
        deadline = time.time() + 45
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            while time.time() < deadline:
                jobs = []
                for _ in range(12):
                    roll, prompt = rng.random(), rng.choice(prompts)
                    if roll < 0.3:
                        jobs.append(normal(http, prompt))
                    elif roll < 0.5:
                        jobs.append(streamed(http, prompt))
                    elif roll < 0.8:
                        jobs.append(hang_up(http, prompt))
                    else:
                        body, status = rng.choice(bad)
                        jobs.append(refused(http, body, status))
                await asyncio.gather(*jobs)

    asyncio.run(main())
    assert not failures, failures[:5]
    settled(server)
    assert server.get("/health")[0] == 200
    assert server_threads(server) <= threads_before + 1  # e.g. a grammar worker, never one per request


def server_threads(server) -> int:
    return int(next(line.split()[1] for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines() if line.startswith("Threads:")))


# ---------------------------------------------------------------------- an engine that cannot go on


@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_dead_engine_fails_open_requests_answers_503_and_exits(how, plugin_path, tmp_path_factory):
    path = tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny"))
    trigger = tmp_path_factory.mktemp("trigger") / "fail"
    flags = ("--model", path, "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--attention-backend", "faulty", "--step-timeout", "2")
    env = {"PYTHONPATH": plugin_path, "FAULTY_TRIGGER": str(trigger), "FAULTY_FORWARD": how}
    with server_process(*flags, env=env) as server:
        failed = []

        def fail_the_forward(event: int) -> None:
            if event == 3:
                trigger.touch()  # the forward fails (or hangs) from now on
                failed.append(time.time())

        body = {"prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True}
        seen = server.stream("/v1/completions", body, fail_the_forward)
        killed = failed[0]
        assert seen[-1] == "[DONE]" and json.loads(seen[-2])["error"]["code"] == "engine_dead", seen[-3:]
        # Non-zero exit within 5 s (3 s of watchdog for a hang); /health is 503 until then.
        statuses = []
        while server.process.poll() is None and time.time() - killed < 8:
            try:
                statuses.append(server.get("/health")[0])
            except OSError:
                pass
            time.sleep(0.1)
        assert server.process.wait(timeout=1) == 3
        assert time.time() - killed < (5 if how == "raise" else 7)
        assert 200 not in statuses[1:]
        log = server.log_text()
        assert "the engine failed" in log and ("faulty attention" in log or "no progress" in log)
