"""The default process group, formed on the first try in every round of a torchrun job.

What the workers of one rendezvous round share, and what they do not (torch 2.13,
``torch/distributed/elastic``):

- ``TORCHELASTIC_RESTART_COUNT`` is per agent: ``max_restarts - remaining_restarts`` of
  that node's agent (``LocalElasticAgent._start_workers``). The agent whose worker failed
  counts one; the others are restarted because a node waits for the next round
  (``num_nodes_waiting() > 0`` in ``SimpleElasticAgent._invoke_run``) and count none. So one
  kill leaves node 0 at 0 and node 1 at 1, and a prefix keyed on it splits the round.
- The rendezvous round (``_RendezvousState.round``) is what all agents of a round agree on,
  but workers are not told it, nor the rendezvous endpoint.
- ``MASTER_ADDR``/``MASTER_PORT`` come from ``RendezvousStoreInfo``. With the shared store
  (the default; ``TORCHELASTIC_USE_AGENT_STORE=True``) they name a ``TCPStore`` that the rank-0
  agent created once (``DynamicRendezvousHandler.next_rendezvous`` caches
  ``_bootstrap_store_info``): the same address in every round, holding every earlier round's
  keys, among them the gloo addresses of dead processes. With
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``TORCHELASTIC_USE_AGENT_STORE=False``) the rank-0
  agent picks a free port per round and nobody listens there: worker rank 0 must host the
  store (``torch.distributed.rendezvous._create_c10d_store``), which is then empty each round.

So the helper (1) hosts the store on rank 0 exactly when the agent does not, and (2) has
the ranks of the round agree on a fresh key prefix through the store itself. Rank 0 takes
a generation number with an atomic ``add``; every other rank posts a random nonce under
its rank and waits for rank 0 to answer that nonce with the generation, then confirms
under the generation. A nonce is new, so only a live rank 0 can answer it; a generation is
new, so no dead process ever wrote a key under it. Rank 0 answers every nonce it reads
until every rank has confirmed, so a stale nonce left by a dead process of an earlier
round costs one unused answer, never a wrong group. This needs only what torchrun
guarantees: a round's workers start after every agent of the round has stopped its
previous workers. One code path serves both modes (in the second the store is new, and
the handshake is a few round trips); the restart counter is not used at all, so a node
lost and replaced, a node added or a count that differs per node change nothing.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time

import torch.distributed as dist

__all__ = ["init_process_group"]

_KEY = "flashckpt/pg"
_POLL_SECONDS = 0.01


def init_process_group(backend: str = "gloo", *, timeout: datetime.timedelta | None = None) -> None:
    """``torch.distributed.init_process_group`` from the launcher's environment
    (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) that forms on the first try
    in every torchrun round, with or without the shared rendezvous store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), whatever each node's restart count says.

    All ranks of the job must call it, once per process group they form. Rank 0 hosts the
    store unless ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's agent hosts it), as the
    stock ``env://`` init does; plain ``python`` launches with those variables work too.
    The ranks then agree on a generation of the group through the store, and the group
    lives under that generation's key prefix, so keys of a dead round are never read.

    ``timeout`` (default ``torch.distributed.default_pg_timeout``) bounds the store
    connection, the agreement and the group's operations; a rank that does not arrive
    within it raises ``torch.distributed.DistStoreError`` naming the ranks missing.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = dist.default_pg_timeout if timeout is None else timeout
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts, timeout=timeout,
                          wait_for_workers=False, multi_tenant=True, use_libuv=True)
    deadline = time.monotonic() + timeout.total_seconds()
    generation = _lead(store, world_size, deadline) if rank == 0 else _follow(store, rank, deadline)
    dist.init_process_group(backend, store=dist.PrefixStore(f"{_KEY}/{generation}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def _lead(store: dist.Store, world_size: int, deadline: float) -> int:
    """Rank 0: take a new generation, answer every rank's nonce until each confirms it."""
    generation = store.add(f"{_KEY}/generation", 1)
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            if store.check([f"{_KEY}/{generation}/joined/{r}"]):
                pending.discard(r)
            elif store.check([f"{_KEY}/hello/{r}"]):
                nonce = store.get(f"{_KEY}/hello/{r}")
                if answered.get(r) != nonce:  # a dead process's nonce gets an answer nobody reads
                    store.set(f"{_KEY}/answer/{nonce.decode()}", str(generation))
                    answered[r] = nonce
        if not pending:
            break
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"flashckpt.torch.init_process_group: ranks {sorted(pending)} did not join generation "
                f"{generation} of the process group in time (started? same MASTER_ADDR/MASTER_PORT?)")
        time.sleep(_POLL_SECONDS)
    return generation


def _follow(store: dist.Store, rank: int, deadline: float) -> int:
    """Any other rank: post a fresh nonce, take rank 0's answer to it, confirm."""
    nonce = secrets.token_hex(16)
    store.set(f"{_KEY}/hello/{rank}", nonce)
    answer = f"{_KEY}/answer/{nonce}"
    try:
        store.wait([answer], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except dist.DistStoreError as e:
        raise dist.DistStoreError(
            f"flashckpt.torch.init_process_group: rank {rank} got no answer from rank 0 "
            f"(started? same MASTER_ADDR/MASTER_PORT?): {e}") from e
    generation = int(store.get(answer))
    store.delete_key(answer)
    store.set(f"{_KEY}/{generation}/joined/{rank}", b"1")
    return generation
