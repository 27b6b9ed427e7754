"""Data parallelism (``--data-parallel-size N``): N engine cores behind one front end.

:class:`DataParallelClient` offers the calls of one core's client
(:class:`~.process_client.ProcessClient`) over N replicas, each a core in a process of
its own (``--data-parallel-backend mp``) or in a Ray actor (``ray``,
:mod:`.ray_executor`); each replica may itself be tensor-parallel. The front end
(tokenizing, detokenizing, the server) stays one.

- **Where a request goes** (:class:`Balancer`): to the live replica with the fewest
  outstanding tokens (prompt tokens not yet computed and tokens still to generate),
  unless a replica already served the request's first prompt blocks and its load is
  not much above the least loaded one's (:meth:`Balancer.affinity_bound`): then to
  it, where its prefix is cached.
- **A replica that dies**: requests that had produced output end with an error naming
  the replica; requests that had not are sent again, once, to a live replica (a
  request that was in flight when two replicas died fails). The replica is started
  again (``data_parallel_max_restarts`` times) and takes load once it is ready. The
  engine as a whole fails only when no replica is left and none is starting.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import hashlib
import logging
import os
import queue
import threading
import time
import weakref
from array import array
from typing import Any, Callable

import attrs

from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.engine.process_client import LocalCore, ProcessClient, take_output
from pyagent_framework.errors import EngineDeadError
from pyagent_framework.messages import AddRequest, CoreError, CoreOutput, CoreOutputs, ErrorCode

logger = logging.getLogger("pyagent_framework.engine")

AFFINITY_BLOCKS = 64  # most leading prompt blocks remembered per request
AFFINITY_ENTRIES = 1 << 17  # most block hashes remembered (least recently used out)
RESENDS = 1  # how many times a request whose replica died is sent again
#: A replica that holds a request's prefix gets it while its load is at most this many
#: times the least loaded replica's, plus the prefix's tokens, plus one step's token
#: budget (max_num_batched_tokens).
AFFINITY_RATIO = 1.5


class Balancer:
    """Chooses a replica per request; the front end's own view of each replica's load.

    ``load[i]``: the tokens replica ``i`` still has to compute for the requests sent
    to it (whole prompts until their first output, then tokens left to generate).
    ``owner``: leading prompt-block hashes (chained, salted as the prefix cache salts
    them) to the replica that first received them (while it lives): a prefix has one
    home, and a request sent elsewhere because its home was busy does not move it.
    """

    def __init__(self, size: int, block_size: int, routing: str = "cache_aware", step_tokens: int = 2048) -> None:
        self.size = size
        self.routing = routing
        self.step_tokens = step_tokens
        self.block_size = block_size
        self.load = [0] * size
        self.requests = [0] * size  # unfinished sequences sent to each
        self.sent = [0] * size  # sequences ever sent to each
        self.live: set[int] = set()
        self.owner: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.affinity_choices = 0
        self.load_choices = 0
        self._next = 0

    def block_hashes(self, request: AddRequest) -> list[bytes]:
        ids, size = request.prompt_token_ids, self.block_size
        digest = hashlib.sha256(b"pyagent dp affinity\0" + (request.cache_salt or "").encode()).digest()
        hashes = []
        for start in range(0, min(len(ids) // size, AFFINITY_BLOCKS) * size, size):
            digest = hashlib.sha256(digest + array("q", ids[start : start + size]).tobytes()).digest()
            hashes.append(digest)
        return hashes

    def assign(self, index: int, load: int) -> None:
        """A sequence of ``load`` tokens was sent to replica ``index``."""
        self.load[index] += load
        self.requests[index] += 1
        self.sent[index] += 1

    def release(self, index: int, load: int) -> None:
        """A sequence with ``load`` tokens left is no longer replica ``index``'s."""
        self.load[index] -= load
        self.requests[index] -= 1

    def affinity_bound(self, least: int, prefix_tokens: int) -> float:
        """The most load a replica holding ``prefix_tokens`` of a request's prompt may
        carry and still get it: a difference one step absorbs costs less than
        computing the prefix again; a large one would pile a popular prefix onto one
        replica."""
        return self.load[least] * AFFINITY_RATIO + prefix_tokens + self.step_tokens

    def choose(self, request: AddRequest) -> int | None:
        """The replica for ``request`` (None when none is live); remembers its blocks."""
        if not self.live:
            return None
        if self.routing == "round_robin":
            chosen = next(i % self.size for i in range(self._next, self._next + self.size) if i % self.size in self.live)
            self._next = (chosen + 1) % self.size
            self.load_choices += 1
            return chosen
        hashes = self.block_hashes(request) if self.routing == "cache_aware" else []
        least = min(self.live, key=lambda i: (self.load[i], self.requests[i], (i - self._next) % self.size))
        chosen = least
        for depth in range(len(hashes), 0, -1):
            owner = self.owner.get(hashes[depth - 1])
            if owner is not None and owner in self.live:
                if owner != least and self.load[owner] <= self.affinity_bound(least, depth * self.block_size):
                    chosen = owner
                break
        if chosen != least:
            self.affinity_choices += 1
        else:
            self.load_choices += 1
            self._next = (least + 1) % self.size
        for digest in hashes:  # a block keeps its live owner: one request spilled elsewhere does not move it
            owner = self.owner.get(digest)
            if owner is None or owner not in self.live:
                self.owner[digest] = chosen
            self.owner.move_to_end(digest)
        while len(self.owner) > AFFINITY_ENTRIES:
            self.owner.popitem(last=False)
        return chosen


@attrs.define(eq=False)
class _Tracked:
    """A sequence sent to a replica, as the front end sees it."""

    request: AddRequest
    ack: concurrent.futures.Future  # the front end's: resolved once some replica has it
    replica: int | None = None  # None: parked until a replica is ready
    load: int = 0  # its share of its replica's load
    prompt_left: bool = True  # no output yet: its prompt is still to compute
    started: bool = False  # it produced output (tokens or prompt logprobs)
    resends: int = 0


def request_load(request: AddRequest, max_model_len: int) -> int:
    prompt = len(request.prompt_token_ids)
    generate = request.params.max_tokens
    return prompt + (generate if generate is not None else max(0, max_model_len - prompt))


class LocalReplicas:
    """Replicas as local processes (``--data-parallel-backend mp``)."""

    name = "mp"

    def __init__(self, config: EngineConfig) -> None:
        self.threads = config.rank_threads(len(os.sched_getaffinity(0)))

    def replica(self, index: int, config: EngineConfig) -> tuple[EngineConfig, Any, str]:
        """Replica ``index``'s configuration, how to start its core, and the host its
        core reaches the front end's sockets on."""
        return attrs.evolve(config, num_threads=self.threads), LocalCore, "127.0.0.1"

    def close(self) -> None:
        pass


class DataParallelClient:
    """N engine cores behind one front end, with the calls of one core's client."""

    def __init__(
        self, config: EngineConfig, *, step_timeout: float | None = None, on_dead: Callable[[BaseException], None] | None = None
    ) -> None:
        self.size = config.data_parallel_size
        self.error: BaseException | None = None
        self.step_started = None  # each core process runs its own watchdog
        self._on_dead = [on_dead] if on_dead is not None else []
        self._config = attrs.evolve(config, data_parallel_size=1)
        self._step_timeout = step_timeout
        self._outputs: queue.Queue = queue.Queue()
        self._lock = threading.RLock()
        self._tracked: dict[str, _Tracked] = {}
        self._parked: list[_Tracked] = []
        self._replayed: dict[str, tuple[str, tuple]] = {}  # LoRA adapters loaded at run time, by name
        self._restarts = [0] * self.size
        self._starting: set[int] = set()
        self._closed = False
        self.max_restarts = config.data_parallel_max_restarts
        self.replicas: list[Any] = [None] * self.size
        self.balancer = Balancer(self.size, config.block_size, config.data_parallel_routing, config.max_num_batched_tokens)
        if config.data_parallel_backend == "ray":
            from pyagent_framework.engine.ray_executor import RayReplicas

            self.launcher = RayReplicas(config)
        else:
            self.launcher = LocalReplicas(config)
        self._stopped = threading.Event()
        starts = [self._on_own_thread(self._start, index) for index in range(self.size)]
        concurrent.futures.wait(starts)
        for index, start in enumerate(starts):
            if start.exception() is None:
                self.replicas[index] = start.result()
                self.balancer.live.add(index)
        failed = next((start.exception() for start in starts if start.exception() is not None), None)
        if failed is not None:
            self.close()
            raise failed
        started = self.replicas
        self.info = started[0].info
        # Closed at exit before what its replicas run on (Ray: registered later, so it
        # would stop first) goes away.
        atexit.register(_close_at_exit, weakref.ref(self))
        logger.info("data parallel: %d replicas (%s), core pids %s", self.size, self.launcher.name,
                    [client.info.pid for client in started])

    def _start(self, index: int):
        config, start, host = self.launcher.replica(index, self._config)
        return ProcessClient(
            config, step_timeout=self._step_timeout, start=start, host=host,
            deliver=lambda outputs: self._delivered(index, outputs),
            on_dead=lambda error: self._replica_died(index, error),
        )

    def _on_own_thread(self, function, *args) -> concurrent.futures.Future:
        """Run ``function`` on a thread that then stays until :meth:`close`: a child
        process gets its parent-death signal when the thread that started it ends."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(function(*args))
            except BaseException as exc:
                future.set_exception(exc)
            self._stopped.wait()

        threading.Thread(target=run, name="pyagent-dp-start", daemon=True).start()
        return future

    def on_dead(self, callback: Callable[[BaseException], None]) -> None:
        self._on_dead.append(callback)

    # ------------------------------------------------------------------ calls

    def add_requests(self, requests: list[AddRequest]) -> list[concurrent.futures.Future]:
        """Each request to its replica; a request's samples go together (one step
        schedules them)."""
        tracked = [_Tracked(request, concurrent.futures.Future()) for request in requests]
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine stopped: {self.error}")
            for item in tracked:
                self._tracked[item.request.request_id] = item
            for group in _by_request(tracked):
                self._dispatch(group, self.balancer.choose(group[0].request))
        return [item.ack for item in tracked]

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                item = self._tracked.get(request_id)
                if item is None:
                    continue
                self._forget(item)
                if item.replica is None:
                    self._parked.remove(item)
                else:
                    by_replica.setdefault(item.replica, []).append(request_id)
        for index, ids in by_replica.items():
            client = self.replicas[index]
            try:
                client.abort_requests(ids)
            except EngineDeadError:  # it died: nothing of these is left there
                pass

    def wake(self) -> None:
        self._outputs.put(None)

    def get_outputs(self, timeout: float | None = None) -> CoreOutputs | None:
        return take_output(self._outputs, timeout)

    def stats(self) -> dict[str, Any]:
        """Every live replica's counters summed (ratios recomputed), and each one's under
        ``replicas`` (with ``replica``, its index, and ``alive``)."""
        per_replica = []
        for index, client in enumerate(list(self.replicas)):
            alive = client is not None and client.error is None and index in self.balancer.live
            stats = client.stats() if alive else {}
            per_replica.append({**stats, "replica": index, "alive": alive, "pid": client.info.pid if alive else None,
                                "outstanding_tokens": self.balancer.load[index],
                                "requests_sent": self.balancer.sent[index]})
        return {**combine_stats([s for s in per_replica if s["alive"]]), "data_parallel_size": self.size,
                "data_parallel_affinity_choices": self.balancer.affinity_choices,
                "data_parallel_load_choices": self.balancer.load_choices,
                "data_parallel_restarts": sum(self._restarts), "replicas": per_replica}

    def call(self, method: str, *args: Any) -> list[Any]:
        """A core utility method (``start_profile``, ...) on every live replica; their
        results in replica order. A LoRA adapter loaded (or unloaded) this way is loaded
        again in a replica that restarts."""
        results = [client.call(method, *args) for index, client in enumerate(list(self.replicas))
                   if client is not None and client.error is None and index in self.balancer.live]
        if method == "add_lora":
            self._replayed[args[0]] = (method, args)
        elif method == "remove_lora":
            self._replayed.pop(args[0], None)
        return results

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = [client for client in self.replicas if client is not None]
        for client in clients:
            try:
                client.close()
            except Exception:
                logger.exception("closing a data-parallel replica failed")
        self.launcher.close()
        self._stopped.set()
        self._die(EngineDeadError("the engine was shut down"), quiet=True)

    # ------------------------------------------------------------------ internals

    def _dispatch(self, items: list[_Tracked], index: int | None) -> None:
        """Send ``items`` (under the lock) to replica ``index``, or park them."""
        if index is None:
            for item in items:
                item.replica = None
            self._parked.extend(items)
            return
        client = self.replicas[index]
        for item in items:
            item.replica = index
            item.load = request_load(item.request, client.info.max_model_len)
            self.balancer.assign(index, item.load)
        try:
            acks = client.add_requests([item.request for item in items])
        except EngineDeadError:
            return  # its death handler (run or about to run) sends them elsewhere
        for item, ack in zip(items, acks):
            ack.add_done_callback(lambda done, item=item, index=index: self._acked(item, index, done))

    def _acked(self, item: _Tracked, index: int, done: concurrent.futures.Future) -> None:
        error = done.exception()
        if item.ack.done():
            return
        if error is None:
            item.ack.set_result(None)
        elif not isinstance(error, EngineDeadError):
            item.ack.set_exception(error)  # its grammar failed: the front end ends it
        # A dead replica: the request is sent again (or failed) by _replica_died.

    def _forget(self, item: _Tracked) -> None:
        self._tracked.pop(item.request.request_id, None)
        if item.replica is not None:
            self.balancer.release(item.replica, item.load)
            item.load = 0

    def _delivered(self, index: int, outputs: CoreOutputs) -> None:
        """A replica's step outputs (on its reader thread): account, then hand on."""
        kept = []
        with self._lock:
            for out in outputs.outputs:
                item = self._tracked.get(out.request_id)
                if item is None or item.replica != index:
                    continue  # aborted, or sent elsewhere since
                kept.append(out)
                done = len(out.new_token_ids)
                if item.prompt_left and (done or out.new_prompt_logprobs or out.finish_reason):
                    done += len(item.request.prompt_token_ids)
                    item.prompt_left = False
                if done or out.new_prompt_logprobs:
                    item.started = True
                spent = min(done, item.load)
                item.load -= spent
                self.balancer.load[index] -= spent
                if out.finish_reason is not None:
                    self._forget(item)
        if kept:
            self._outputs.put(CoreOutputs(kept, outputs.timestamp) if len(kept) != len(outputs.outputs) else outputs)

    def _replica_died(self, index: int, error: BaseException) -> None:
        """Fail what replica ``index`` had started, send the rest elsewhere, start it again."""
        with self._lock:
            if self._closed:
                return
            self.balancer.live.discard(index)
            mine = [item for item in self._tracked.values() if item.replica == index]
            failed, again = [], []
            for item in mine:
                self._forget(item)
                (failed if item.started or item.resends >= RESENDS else again).append(item)
            restart = self._restarts[index] < self.max_restarts
            if restart:
                self._restarts[index] += 1
                self._starting.add(index)
            logger.error("data-parallel replica %d stopped (%s): %d request(s) fail, %d sent again%s",
                         index, error, len(failed), len(again), "; starting it again" if restart else "")
            message = f"data-parallel replica {index} stopped while this request ran: {error}"
            for item in failed:
                if not item.ack.done():
                    item.ack.set_exception(EngineDeadError(message))
            if failed:
                self._outputs.put(CoreOutputs(
                    [CoreOutput(item.request.request_id, finish_reason="error", error=CoreError(ErrorCode.INTERNAL, message))
                     for item in failed], time.time()))
            for item in again:
                item.resends += 1
                item.prompt_left = True
                self._tracked[item.request.request_id] = item
                self._dispatch([item], self.balancer.choose(item.request))
            if not self.balancer.live and not self._starting:
                self._die(EngineDeadError(f"every data-parallel replica stopped (the last: replica {index}: {error})"))
        if restart:
            self._on_own_thread(self._restart, index)

    def _restart(self, index: int) -> None:
        old = self.replicas[index]
        try:
            old.close()
        except Exception:
            pass
        try:
            client = self._start(index)
            for method, args in list(self._replayed.values()):  # LoRA adapters loaded since the start
                client.call(method, *args)
        except Exception as exc:
            logger.error("data-parallel replica %d did not start again: %s", index, exc)
            with self._lock:
                self._starting.discard(index)
                if not self.balancer.live and not self._starting:
                    self._die(EngineDeadError(f"every data-parallel replica stopped (replica {index} did not start again: {exc})"))
            return
        with self._lock:
            self._starting.discard(index)
            if self._closed:
                client.close()
                return
            self.replicas[index] = client
            self.balancer.live.add(index)
            parked, self._parked = self._parked, []
            logger.warning("data-parallel replica %d is serving again (core pid %d)", index, client.info.pid)
            for item in parked:
                self._dispatch([item], self.balancer.choose(item.request))

    def _die(self, error: BaseException, quiet: bool = False) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            parked, self._parked = self._parked, []
        for item in parked:
            if not item.ack.done():
                item.ack.set_exception(error)
        self._outputs.put(error)
        if not quiet:
            logger.critical("%s", error)
            for callback in self._on_dead:
                try:
                    callback(error)
                except Exception:
                    logger.exception("an on_dead callback failed")


def _close_at_exit(client: "weakref.ref[DataParallelClient]") -> None:
    live = client()
    if live is not None:
        live.close()


def _by_request(items: list[_Tracked]) -> list[list[_Tracked]]:
    """Split a batch (an ``LLM.generate`` call's prompts) into requests: a request's
    samples follow its first (``sample_index`` 0) and stay together."""
    groups: list[list[_Tracked]] = []
    for item in items:
        if item.request.sample_index == 0 or not groups:
            groups.append([])
        groups[-1].append(item)
    return groups


def combine_stats(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed; usage a block-weighted mean; the hit rate hits over queries;
    anything not a number from the first replica."""
    combined: dict[str, Any] = {}
    for stats in replicas:
        for key, value in stats.items():
            if key in ("replica", "alive", "pid", "outstanding_tokens", "requests_sent"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                combined[key] = combined.get(key, 0) + value
            else:
                combined.setdefault(key, value)
    blocks = sum(stats.get("num_kv_blocks", 0) for stats in replicas)
    if blocks:
        combined["kv_cache_usage"] = sum(stats.get("kv_cache_usage", 0.0) * stats.get("num_kv_blocks", 0) for stats in replicas) / blocks
    queries = combined.get("prefix_cache_queries", 0)
    if "prefix_cache_hit_rate" in combined:
        combined["prefix_cache_hit_rate"] = combined.get("prefix_cache_hits", 0) / queries if queries else 0.0
    return combined
