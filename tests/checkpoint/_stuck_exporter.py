"""An exporter the test suite registers (entry-point group ``flashckpt.exporters``, see
``test_export_timeout``) that stops at a chosen point: it creates ``params["started"]``,
then blocks reading the FIFO ``params["fifo"]`` until the test writes to it."""

import os


def export(directory: str, step: int, params: dict, *, memory=None) -> None:
    with open(params["started"], "w") as f:
        f.write(f"{step}\n")
    with open(params["fifo"]) as fifo:  # blocks until a writer opens it
        fifo.read()
    if memory is not None:
        memory.release()
    os.makedirs(os.path.join(directory, f"exported-{step}"), exist_ok=True)
