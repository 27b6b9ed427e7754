"""The engine on a Ray cluster (``pip install 'pyagent-framework[ray]'``).

- ``--data-parallel-backend ray`` (:class:`RayReplicas`): each replica's engine core
  runs in a Ray actor, in a placement group of its own that reserves its CPUs
  (``num_threads`` x ``tensor_parallel_size``). The actor is started again by Ray when
  it dies (``max_restarts``: ``data_parallel_max_restarts``), and the data-parallel
  client (:mod:`.data_parallel`) puts it back behind the balancer once it is ready.
- ``--distributed-executor-backend ray`` (:class:`RayWorkers`): tensor-parallel ranks 1
  to N-1 run in Ray actors of one placement group instead of local processes.

What Ray carries is only what starts an actor: the engine's start-up as msgpack
bytes and socket addresses. Step inputs and outputs do not go through Ray: the cores
speak to the front end over ZMQ (typed msgpack) and tensor-parallel ranks over
``torch.distributed``. The front end binds its sockets on 127.0.0.1 when every node of
the cluster is this machine, else on this node's address in the cluster.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import msgspec

from pyagent_framework.engine.config import EngineConfig
from pyagent_framework.errors import ConfigError
from pyagent_framework.messages import CoreStartup

logger = logging.getLogger("pyagent_framework.engine")

RAY_EXITED = -9  # the exit status reported for an actor that died


def import_ray(field: str):
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "ray" not in sys.modules and "RAY_AUTH_MODE" not in os.environ and token.is_file():
        # A cluster from `ray start` authenticates by this machine's token; a driver
        # that joins it sends the token only when RAY_AUTH_MODE says so (read on import).
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"{field} 'ray' needs Ray, which is not installed: pip install 'pyagent-framework[ray]' "
            f"(or use {field} mp)",
            field=field,
        ) from None
    return ray


def connect(config: EngineConfig, field: str):
    """Ray, joined to ``ray_address`` (or RAY_ADDRESS, or a local instance it starts)
    unless this process already is."""
    ray = import_ray(field)
    if not ray.is_initialized():
        try:
            address = config.ray_address or os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=False)
        except ConnectionError as exc:
            raise ConfigError(f"ray_address {address!r}: cannot join the Ray cluster: {exc}",
                              field="ray_address") from None
    return ray


def front_end_host(ray) -> str:
    """Where the cores reach the front end's sockets: loopback on a one-machine cluster."""
    here = ray.util.get_node_ip_address()
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if all(node.get("NodeManagerAddress") == here for node in nodes):
        return "127.0.0.1"
    return here


def reserve(ray, bundles: list[dict[str, float]], timeout: float, what: str, field: str):
    """A placement group of ``bundles``, ready within ``timeout`` seconds; else a
    ConfigError naming what is missing."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if ready:
        return group
    remove_placement_group(group)
    available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    raise ConfigError(
        f"the Ray cluster could not reserve {what} within {timeout:g} s (ray_placement_timeout): it needs "
        f"{bundles}; the cluster has {total} in all and {available} free. Add nodes, or lower {field} or "
        "num_threads",
        field=field,
    )


def call_status(ray, ref) -> int | None:
    """How the actor call behind ``ref`` ended, as a process's exit status: None while
    it runs, its result (0 for None), :data:`RAY_EXITED` if its actor died or this
    process left the cluster (at exit), 1 if it raised."""
    if not ray.is_initialized():
        return RAY_EXITED
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return None
    try:
        return int(ray.get(ref) or 0)
    except ray.exceptions.RayActorError:
        return RAY_EXITED
    except Exception:
        return 1


def actor_name(actor) -> str:
    return f"Ray actor {actor._actor_id.hex()[:12]}"


class CoreActor:
    """A Ray actor that runs one engine core (``core_process.serve``) per call."""

    def serve(self, startup: bytes, input_address: str, output_address: str) -> int:
        from pyagent_framework.engine import core_process

        return core_process.serve(msgspec.msgpack.decode(startup, type=CoreStartup), input_address, output_address)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayCore:
    """One ``serve`` call on a core actor, as the process client sees a child."""

    transport = "tcp"

    def __init__(self, actor, startup: CoreStartup, input_address: str, output_address: str) -> None:
        import ray

        self.ray, self.actor = ray, actor
        self.name = actor_name(actor)
        self.pid = None
        self.ref = actor.serve.remote(msgspec.msgpack.encode(startup), input_address, output_address)

    def exit_status(self) -> int | None:
        return call_status(self.ray, self.ref)

    def stop(self, *, kill: bool, wait_seconds: float) -> None:
        """Wait for ``serve`` to return (the core was told to stop); kill the actor's
        process first with ``kill`` or if it does not (Ray starts it again while it
        has restarts left; :meth:`RayReplicas.close` ends it for good)."""
        if not kill:
            ready, _ = self.ray.wait([self.ref], timeout=wait_seconds)
            if ready:
                return
        if self.exit_status() is None:
            self.ray.kill(self.actor, no_restart=False)


class RayReplicas:
    """Data-parallel replicas as Ray actors, one placement group each."""

    name = "ray"

    def __init__(self, config: EngineConfig) -> None:
        ray = connect(config, "data_parallel_backend")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        size = config.data_parallel_size
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.threads = config.rank_threads(cpus)
        bundle = {"CPU": float(self.threads * config.tensor_parallel_size)}
        self.host = front_end_host(ray)
        self.groups: list[Any] = []
        self.actors: list[Any] = []
        try:
            for index in range(size):
                self.groups.append(
                    reserve(ray, [bundle], config.ray_placement_timeout, f"data-parallel replica {index} of {size}",
                            "data_parallel_size")
                )
            remote = ray.remote(CoreActor)
            for group in self.groups:
                self.actors.append(remote.options(
                    num_cpus=bundle["CPU"], max_restarts=config.data_parallel_max_restarts, max_concurrency=2,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                ).remote())
        except BaseException:
            self.close()
            raise

    def replica(self, index: int, config: EngineConfig) -> tuple[EngineConfig, Any, str]:
        """Replica ``index``'s configuration, how to start its core (a ``serve`` call
        on its actor) and the host its core reaches the front end's sockets on."""
        actor = self.actors[index]
        return (attrs.evolve(config, num_threads=self.threads),
                lambda startup, inbox, outbox: RayCore(actor, startup, inbox, outbox), self.host)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        self.actors, self.groups = [], []


class WorkerActor:
    """A Ray actor that holds one tensor-parallel rank: ``load`` builds it, ``run``
    joins the group and computes every step (:mod:`.tensor_parallel`)."""

    def load(self, startup: bytes) -> int:
        """Build the rank; returns this process's pid."""
        from pyagent_framework.engine import tensor_parallel

        self.startup = msgspec.msgpack.decode(startup, type=tensor_parallel.WorkerStartup)
        tensor_parallel.choose_gloo_interface(self.startup.address.removeprefix("tcp://").rsplit(":", 1)[0])
        self.built = tensor_parallel.build_rank(self.startup)
        return os.getpid()

    def run(self) -> None:
        from pyagent_framework.engine import tensor_parallel

        tensor_parallel.run_steps(self.startup, *self.built)


class RayWorker:
    """One tensor-parallel rank in a Ray actor, as the engine core sees a worker."""

    def __init__(self, ray, actor, startup) -> None:
        self.ray, self.actor = ray, actor
        self.name = actor_name(actor)
        self.loaded = actor.load.remote(msgspec.msgpack.encode(startup))
        self.ref = None
        self.pid = None

    def wait_ready(self, rank: int) -> None:
        try:
            self.pid = self.ray.get(self.loaded)
        except self.ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise RuntimeError(f"tensor-parallel worker {rank} ({self.name}) failed to start: {cause}") from None
        self.name += f" (pid {self.pid})"
        self.ref = self.actor.run.remote()

    def exit_status(self) -> int | None:
        """None until the rank runs steps (:meth:`wait_ready` reports a failed load)."""
        return call_status(self.ray, self.ref) if self.ref is not None else None

    def stop(self, *, kill: bool, wait_seconds: float) -> None:
        if not kill and self.ref is not None:
            self.ray.wait([self.ref], timeout=wait_seconds)
        self.ray.kill(self.actor, no_restart=True)


class RayWorkers:
    """Tensor-parallel ranks 1 to N-1 as Ray actors, one placement group for them all
    (``num_threads`` CPUs each)."""

    def __init__(self, config: EngineConfig, size: int, threads: int) -> None:
        ray = connect(config, "distributed_executor_backend")
        self.ray = ray
        self.threads = threads
        self.host = front_end_host(ray)
        self.group = reserve(ray, [{"CPU": float(threads)}] * (size - 1), config.ray_placement_timeout,
                             f"{size - 1} tensor-parallel worker(s)", "tensor_parallel_size")
        self.remote = ray.remote(WorkerActor)
        self.started = 0

    def start(self, startup) -> RayWorker:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self.remote.options(
            num_cpus=self.threads,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.started),
        ).remote()
        self.started += 1
        return RayWorker(self.ray, actor, startup)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:
                pass
            self.group = None
