"""An exporter the test suite registers (entry-point group ``flashckpt.exporters``, see
``test_exporter_registry``): it writes what it was called with to ``params["out"]``."""

import json


def export(directory: str, step: int, params: dict, *, memory=None) -> None:
    with open(params["out"], "w") as f:
        json.dump({"directory": directory, "step": step, "params": params, "memory": memory is not None}, f)
