"""Tensor-parallel workers on local processes (``--tensor-parallel-size N``, the ``mp``
executor): ranks 1 to N-1 of a ``torch.distributed`` group (gloo, over TCP on
127.0.0.1) whose rank 0 is the engine core itself.

The engine core builds its rank of the model (:mod:`pyagent_framework.parallel`),
sizes the KV cache, then starts the workers: ``python -m
pyagent_framework.engine.tensor_parallel``, each given on its standard input (msgpack,
never a pickle) the engine configuration, its rank, the names the core resolved, the
number of KV blocks and the group's address. A worker builds its rank of the model
and a cache of the same blocks, joins the group, and then runs every step the core
runs: the core broadcasts each step's :class:`~pyagent_framework.engine.model_runner.StepInputs`
as tensors (a header of sizes, then the tensors), and both sides call
:func:`~pyagent_framework.engine.model_runner.run_step`, whose all-reduces and
all-gathers meet. The scheduler, the KV block pool, sampling and the requests stay on
rank 0: a worker only computes.

A worker that dies breaks the next collective; the core's forward then fails and the
engine with it (the fault rules: only a forward failure is an engine failure). A worker
whose core is gone sees its standard input close and exits; one that waits longer than
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


class TensorParallelWorkers:
    """Ranks 1 to ``size - 1``, started by rank 0 (the engine core) once its model and
    cache exist; joins the group as rank 0 before returning."""

    def __init__(self, config, *, size: int, num_blocks: int, threads: int, attention_backend: str, quantization: str | None) -> None:
        import torch.distributed as dist

        self.size = size
        address = f"tcp://127.0.0.1:{child_process.free_port()}"
        # gloo's own connections bind to the hostname's address unless told an
        # interface: loopback, as everything this engine opens by default.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.processes: list[subprocess.Popen] = []
        try:
            for rank in range(1, size):
                process = subprocess.Popen(
                    [sys.executable, "-m", "pyagent_framework.engine.tensor_parallel"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                )
                self.processes.append(process)
                child_process.write_startup(
                    process,
                    WorkerStartup(attrs.asdict(config), rank, size, address, num_blocks, threads, attention_backend, quantization),
                )
            for rank, process in enumerate(self.processes, start=1):
                # One line once the worker's model and cache are built, or its error.
                line = process.stdout.readline().decode(errors="replace").strip()
                if line != "ready":
                    process.wait(10)
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} failed to start: {line or f'exit status {process.returncode}'}"
                    )
            dist.init_process_group("gloo", init_method=address, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self._stop(kill=True)
            raise
        logger.info("tensor parallel: %d ranks (workers %s)", size, [p.pid for p in self.processes])

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
        dead = [(p.pid, p.returncode) for p in self.processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) exited: {', '.join(f'pid {pid} (status {rc})' for pid, rc in dead)}")

    def close(self) -> None:
        """Stop the workers (a stop message when the group still works) and leave the group."""
        import torch.distributed as dist

        try:
            if all(p.poll() is None for p in self.processes):
                _broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64))
        except Exception:  # a broken group: the workers are killed below
            pass
        self._stop(kill=False)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop(self, *, kill: bool) -> None:
        for process in self.processes:
            child_process.stop(process, kill=kill, wait_seconds=10.0)


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


def main() -> int:
    import torch.distributed as dist

    from pyagent_framework import parallel
    from pyagent_framework.engine import loader, setup
    from pyagent_framework.engine.config import EngineConfig

    child_process.die_with_parent()
    startup = child_process.read_startup(WorkerStartup)
    threading.Thread(target=child_process.watch_stdin, name="pyagent-rank0-watch", daemon=True).start()
    logging.basicConfig(level=os.environ.get("PYAGENT_CORE_LOG_LEVEL", "WARNING"),
                        format=f"%(levelname)s %(name)s [rank {startup.rank}]: %(message)s")
    torch.set_num_threads(startup.threads)
    try:
        config = EngineConfig(**startup.config)
        path = loader.resolve_model(config.model, config.gguf_file)
        weight_format = loader.choose_weight_format(path, config.weight_format)
        with parallel.building(parallel.TensorParallel(startup.rank, startup.size)):
            model = loader.build_model(
                path, weight_format.load_config(path), weight_format=weight_format,
                attention_backend=startup.attention_backend, quantization=startup.quantization,
                quantization_config=config.quantization_config, dtype=config.dtype, device="cpu",
            )
        config = attrs.evolve(config, num_kv_blocks=startup.num_blocks)
        kv_cache, _ = setup.allocate_kv_cache(config, model, 0, "cpu")
        kv_caches = list(kv_cache.unbind(0))
    except Exception as exc:  # rank 0 reports it, by rank
        os.write(1, f"{type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        return 1
    os.write(1, b"ready\n")
    os.dup2(2, 1)  # rank 0 reads no more of our stdout: anything printed later goes to stderr
    dist.init_process_group("gloo", init_method=startup.address, rank=startup.rank, world_size=startup.size,
                            timeout=COLLECTIVE_TIMEOUT)
    with torch.inference_mode():
        while (inputs := _receive_step()) is not None:
            run_step(model, kv_caches, config.block_size, inputs, "cpu")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
