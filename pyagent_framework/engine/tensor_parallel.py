"""Tensor-parallel workers (``--tensor-parallel-size N``): ranks 1 to N-1 of a
``torch.distributed`` group (gloo, over TCP) whose rank 0 is the engine core itself.
They run as local processes (``--distributed-executor-backend mp``, the default; the
group on 127.0.0.1) or as Ray actors in a placement group (``ray``,
:class:`~.ray_executor.RayWorkers`).

The engine core builds its rank of the model (:mod:`pyagent_framework.parallel`),
sizes the KV cache, then starts the workers: ``python -m
pyagent_framework.engine.tensor_parallel``, each given on its standard input (msgpack,
never a pickle; a Ray actor gets the same bytes) the engine configuration, its rank, the names the core resolved, the
number of KV blocks and the group's address. A worker builds its rank of the model
and a cache of the same blocks, joins the group, and then runs every step the core
runs: the core broadcasts each step's :class:`~pyagent_framework.engine.model_runner.StepInputs`
as tensors (a header of sizes, then the tensors), and both sides call
:func:`~pyagent_framework.engine.model_runner.run_step`, whose all-reduces and
all-gathers meet. The scheduler, the KV block pool, sampling and the requests stay on
rank 0: a worker only computes.

A worker that dies breaks the next collective; the core's forward then fails and the
engine with it (the fault rules: only a forward failure is an engine failure). A worker
process whose core is gone sees its standard input close and exits (Ray ends the
actors of a core that is gone); one that waits longer than
:data:`COLLECTIVE_TIMEOUT` for a step's peers gives up.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
from typing import Any

import attrs
import msgspec
import torch

from pyagent_framework.engine import child_process
from pyagent_framework.engine.model_runner import StepInputs, run_step

logger = logging.getLogger(__name__)

#: How long a collective waits for the other ranks (a step, or joining the group).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
_STEP, _STOP = 1, 0
_HEADER = 8  # op, tokens, sequences, blocks per table, max query len, max seq len, row groups, spare


class WorkerStartup(msgspec.Struct, frozen=True):
    """What a worker is started with (on its standard input)."""

    config: dict[str, Any]
    rank: int
    size: int
    address: str  # tcp://127.0.0.1:PORT of the group's store, kept by rank 0
    num_blocks: int
    threads: int
    attention_backend: str
    quantization: str | None


class LocalWorker(child_process.Child):
    """A worker as a child process of the engine core (the ``mp`` executor)."""

    def __init__(self, startup: WorkerStartup) -> None:
        super().__init__("pyagent_framework.engine.tensor_parallel", [], startup, label="pid", stdout=subprocess.PIPE)

    def wait_ready(self, rank: int) -> None:
        """One line once the worker's model and cache are built, or its error."""
        line = self.process.stdout.readline().decode(errors="replace").strip()
        if line != "ready":
            self.process.wait(10)
            raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {line or f'exit status {self.process.returncode}'}")


class TensorParallelWorkers:
    """Ranks 1 to ``size - 1``, started by rank 0 (the engine core) once its model and
    cache exist, as local processes or Ray actors (``distributed_executor_backend``);
    joins the group as rank 0 before returning."""

    def __init__(self, config, *, size: int, num_blocks: int, threads: int, attention_backend: str, quantization: str | None) -> None:
        import torch.distributed as dist

        self.size = size
        self.workers: list[Any] = []
        self.launcher = None
        host = "127.0.0.1"
        if config.distributed_executor_backend == "ray":
            from pyagent_framework.engine.ray_executor import RayWorkers

            self.launcher = RayWorkers(config, size, threads)
            host = self.launcher.host
        address = f"tcp://{host}:{child_process.free_port(host)}"
        choose_gloo_interface(host)
        try:
            for rank in range(1, size):
                startup = WorkerStartup(attrs.asdict(config), rank, size, address, num_blocks, threads, attention_backend, quantization)
                self.workers.append(self.launcher.start(startup) if self.launcher is not None else LocalWorker(startup))
            for rank, worker in enumerate(self.workers, start=1):
                worker.wait_ready(rank)
            dist.init_process_group("gloo", init_method=address, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self._stop(kill=True)
            raise
        logger.info("tensor parallel: %d ranks (workers %s)", size, [worker.name for worker in self.workers])

    def send_step(self, inputs: StepInputs) -> None:
        """Broadcast one step's inputs to every worker."""
        self._check_alive()
        sizes = torch.tensor([len(rows) for rows in inputs.logit_rows], dtype=torch.int64)
        header = torch.tensor(
            [_STEP, len(inputs.input_ids), len(inputs.seq_lens), inputs.block_tables.shape[1], inputs.max_query_len,
             inputs.max_seq_len, len(sizes), 0],
            dtype=torch.int64,
        )
        _broadcast(header)
        rows = torch.cat(inputs.logit_rows) if inputs.logit_rows else torch.empty(0, dtype=torch.int64)
        for tensor in (sizes, inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                       inputs.seq_lens, inputs.block_tables, rows):
            _broadcast(tensor.contiguous())

    def _check_alive(self) -> None:
        dead = [(worker.name, status) for worker in self.workers if (status := worker.exit_status()) is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) exited: {', '.join(f'{name} (status {rc})' for name, rc in dead)}")

    def close(self) -> None:
        """Stop the workers (a stop message when the group still works) and leave the group."""
        import torch.distributed as dist

        try:
            if all(worker.exit_status() is None for worker in self.workers):
                _broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))
        except Exception:  # a broken group: the workers are killed below
            pass
        self._stop(kill=False)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop(self, *, kill: bool) -> None:
        for worker in self.workers:
            worker.stop(kill=kill, wait_seconds=10.0)
        if self.launcher is not None:
            self.launcher.close()


def choose_gloo_interface(peer: str) -> None:
    """gloo's own connections bind to the hostname's address unless told an interface
    (GLOO_SOCKET_IFNAME): unless it is set, loopback for a group on 127.0.0.1 (as
    everything this engine opens by default), else the interface this host reaches
    rank 0's address ``peer`` through."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    name = "lo" if peer == "127.0.0.1" else _interface_towards(peer)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _interface_towards(peer: str) -> str | None:
    """The name of the interface holding the address this host sends to ``peer`` from
    (Linux; None elsewhere or when none matches)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))  # no packet is sent: this only picks the route
            local = probe.getsockname()[0]
        except OSError:
            return None
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == local:
                return name
    return None


def _broadcast(tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.broadcast(tensor, src=0)


def _receive_step() -> StepInputs | None:
    """The next step's inputs from rank 0, or None when it says stop."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    _broadcast(header)
    op, tokens, seqs, blocks, max_query_len, max_seq_len, groups, _ = header.tolist()
    if op == _STOP:
        return None
    sizes = torch.empty(groups, dtype=torch.int64)
    _broadcast(sizes)
    shapes = [
        ((tokens,), torch.int64), ((tokens,), torch.int64), ((tokens,), torch.int64), ((seqs + 1,), torch.int32),
        ((seqs,), torch.int32), ((seqs, blocks), torch.int32), ((int(sizes.sum()),), torch.int64),
    ]
    received = []
    for shape, dtype in shapes:
        tensor = torch.empty(shape, dtype=dtype)
        _broadcast(tensor)
        received.append(tensor)
    input_ids, positions, slots, starts, seq_lens, tables, rows = received
    return StepInputs(
        input_ids, positions, slots, starts, seq_lens, tables, max_query_len, max_seq_len,
        list(rows.split(sizes.tolist())) if groups else [],
    )


def build_rank(startup: WorkerStartup):
    """This rank's model and KV cache (the same blocks as rank 0's)."""
    from pyagent_framework import parallel
    from pyagent_framework.engine import loader, setup
    from pyagent_framework.engine.config import EngineConfig

    torch.set_num_threads(startup.threads)
    config = EngineConfig(**startup.config)
    path = loader.resolve_model(config.model, config.gguf_file)
    _, weight_format = loader.choose_weight_format(path, config.weight_format)
    with parallel.building(parallel.TensorParallel(startup.rank, startup.size)):
        model = loader.build_model(
            path, weight_format.load_config(path), weight_format=weight_format,
            attention_backend=startup.attention_backend, quantization=startup.quantization,
            quantization_config=config.quantization_config, dtype=config.dtype, device="cpu",
        )
    config = attrs.evolve(config, num_kv_blocks=startup.num_blocks)
    kv_cache, _ = setup.allocate_kv_cache(config, model, 0, "cpu")
    return model, list(kv_cache.unbind(0)), config.block_size


def run_steps(startup: WorkerStartup, model, kv_caches: list[torch.Tensor], block_size: int) -> None:
    """Join the group and run every step rank 0 broadcasts, until it says stop."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=startup.address, rank=startup.rank, world_size=startup.size,
                            timeout=COLLECTIVE_TIMEOUT)
    with torch.inference_mode():
        while (inputs := _receive_step()) is not None:
            run_step(model, kv_caches, block_size, inputs, "cpu")
    dist.destroy_process_group()


def main() -> int:
    child_process.die_with_parent()
    startup = child_process.read_startup(WorkerStartup)
    threading.Thread(target=child_process.watch_stdin, name="pyagent-rank0-watch", daemon=True).start()
    logging.basicConfig(level=os.environ.get("PYAGENT_CORE_LOG_LEVEL", "WARNING"),
                        format=f"%(levelname)s %(name)s [rank {startup.rank}]: %(message)s")
    try:
        built = build_rank(startup)
    except Exception as exc:  # rank 0 reports it, by rank
        os.write(1, f"{type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        return 1
    os.write(1, b"ready\n")
    os.dup2(2, 1)  # rank 0 reads no more of our stdout: anything printed later goes to stderr
    run_steps(startup, *built)
    return 0


if __name__ == "__main__":
    sys.exit(main())
