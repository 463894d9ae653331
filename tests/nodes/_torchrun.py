"""torchrun for the multi-node tests, with its stacks on demand.

    python _torchrun.py TORCHRUN_ARGS...   (as ``python -m torch.distributed.run``)

With ``FCN_STACKS`` set to a directory, SIGUSR1 writes every thread's Python stack (the main
loop, the rendezvous keep-alive thread) to ``FCN_STACKS/stacks-agent-<host>-<pid>.txt``: a
stalled test asks each agent and worker for its stacks before it kills them.
"""

import faulthandler
import os
import signal
import socket

from torch.distributed.run import main

if __name__ == "__main__":
    if os.environ.get("FCN_STACKS"):
        stacks = open(os.path.join(os.environ["FCN_STACKS"], f"stacks-agent-{socket.gethostname()}-{os.getpid()}.txt"),
                      "w")
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    main()
