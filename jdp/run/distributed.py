"""Multi-process runs on JAX's own multi-controller runtime (`jax.distributed`), failing loudly.

Every process runs the same program on its own devices; jdp's step sees the global mesh, and
each process feeds only its slice of the global batch. What can go wrong is made to fail fast
with a sentence: a coordinator that cannot be reached (checked before jax would abort the
process), processes that disagree about the run (`agree`), and a peer that dies (jax's
coordination service stops the survivors within `heartbeat_s`).
"""
from __future__ import annotations

import hashlib
import json
import socket
import time

import jax
import numpy as np

from jdp.cpu import backends_started


def _parse(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {address!r} must be HOST:PORT with a port from 1 to 65535.")
    return host, int(port)


def _wait_for_coordinator(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ValueError(f"the coordinator {host}:{port} is unreachable after {timeout_s:g} s; start "
                                 f"process 0 first, or check --coordinator.") from None
            time.sleep(0.2)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("" if host in ("localhost", "127.0.0.1", "0.0.0.0") else host, port))
        except OSError as e:
            raise ValueError(f"process 0 cannot host the coordinator on port {port} ({e.strerror}): another "
                             f"program holds it, or another process was started with --process-id 0; choose "
                             f"another --coordinator port, or give each process its own --process-id.") from None


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
               timeout_s: float = 60.0, heartbeat_s: int = 10) -> None:
    """Join a multi-process run (call before any jax computation).

    With `coordinator=None`, jax's cluster auto-detection (SLURM, Open MPI, ...) is used.
    Raises ValueError for bad arguments, an unreachable coordinator or a busy port.
    """
    if backends_started():
        raise ValueError("jax.distributed must be initialised before any jax computation.")
    if coordinator is None:
        try:
            jax.distributed.initialize(initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=heartbeat_s)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"could not detect a cluster to join ({str(e).splitlines()[0]}); pass --coordinator, "
                             f"--num-processes and --process-id.") from None
        return
    host, port = _parse(coordinator)
    if num_processes is None or num_processes < 1:
        raise ValueError(f"--num-processes {num_processes} must be at least 1 with --coordinator.")
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} must be in 0..{num_processes - 1}.")
    if process_id == 0:
        _check_port_free(host, port)
    else:  # jax would abort (not raise) after its timeout; find out first, with a sentence
        _wait_for_coordinator(host, port, timeout_s)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=heartbeat_s)


def _gather(values: np.ndarray) -> np.ndarray:
    """(P, ...) : every process's `values`, on every process.

    Over one device per process (each one's first), so it works before the processes are known to
    have the same number of devices (`multihost_utils.process_allgather` reshapes by that number).
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    firsts = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
              for p in range(jax.process_count())]
    mesh = Mesh(np.array(firsts), ("processes",))
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("processes")),
                                                  np.asarray(values)[None])
    everyone = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    return np.asarray(everyone.addressable_data(0))


def agree(facts: dict) -> None:
    """Stop every process, naming what differs, unless all processes pass equal `facts`.

    `facts` is a JSON-able dict (e.g. the config's hash, the dataset size, the step count). The
    comparison is one all-gather of a digest; only on a mismatch are the facts themselves gathered.
    """
    if jax.process_count() == 1:
        return
    blob = json.dumps(facts, sort_keys=True).encode()
    digest = np.frombuffer(hashlib.sha256(blob).digest(), np.uint8)
    digests = _gather(digest)
    if (digests == digests[0]).all():
        return
    size = int(_gather(np.array([len(blob)], np.int64)).max())  # the longest process's facts
    padded = np.zeros(size, np.uint8)
    padded[:len(blob)] = np.frombuffer(blob, np.uint8)
    raise ValueError(disagreement([json.loads(bytes(row).rstrip(b"\0")) for row in _gather(padded)]))


def disagreement(everyone: list[dict]) -> str:
    """The sentence for processes whose facts differ (`everyone`: each process's, in process order),
    naming each differing field with every process's value."""
    diffs = sorted({k for f in everyone for k in f if f.get(k) != everyone[0].get(k)})
    if len(diffs) > 1 and "config" in diffs:  # the digest of fields named here anyway
        diffs.remove("config")
    detail = "; ".join(f"{k}: " + ", ".join(f"process {i} {f.get(k)!r}" for i, f in enumerate(everyone))
                       for k in diffs)
    return (f"the {len(everyone)} processes disagree about the run ({detail}); start them all with the same "
            f"config and data.")


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any (e.g. a stop request), so all stop together."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(_gather(np.array([flag], np.int32)).any())
