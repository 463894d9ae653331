"""torchrun for the multi-node tests, with its stacks on demand.

    python _torchrun.py TORCHRUN_ARGS...   (as ``python -m torch.distributed.run``)

With ``FCN_STACKS`` set to a directory, SIGUSR1 writes every thread's Python stack (the main
loop, the rendezvous keep-alive thread) to ``FCN_STACKS/stacks-agent-<host>-<pid>.txt``: a
stalled test asks each agent and worker for its stacks before it kills them.

:func:`agent_argv` is the command of one node's agent in a job on ``Nodes`` (tests, benchmarks).
"""

import faulthandler
import os
import signal
import socket
import sys

AGENT = os.path.abspath(__file__)  # torchrun, its stacks on SIGUSR1
RDZV_PORT = 29400  # each node has a network namespace of its own: any port is free


def agent_argv(nodes, script: list[str], *, nproc: int, max_restarts: int, rdzv_conf: str = "",
               options: tuple[str, ...] = ()) -> list[str]:
    """This file's torchrun on a node of ``nodes`` (``tests.nodes._netns.Nodes``; every node runs the
    same command) for ``script`` (the worker and its arguments): ``len(nodes)`` nodes of ``nproc``
    workers, c10d rendezvous on node0, ``options`` (more of torchrun's) before the script."""
    return [sys.executable, AGENT, f"--nnodes={len(nodes.namespaces)}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.hostnames[0]}:{RDZV_PORT}",
            f"--rdzv-id={nodes.namespaces[0]}", f"--rdzv-conf={rdzv_conf}", f"--max-restarts={max_restarts}",
            *options, *script]


if __name__ == "__main__":
    from torch.distributed.run import main

    if os.environ.get("FCN_STACKS"):
        stacks = open(os.path.join(os.environ["FCN_STACKS"], f"stacks-agent-{socket.gethostname()}-{os.getpid()}.txt"),
                      "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    main()
