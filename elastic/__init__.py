"""elastic: the fault-tolerant agent and elastic data for distributed training.

Importing this package imports no framework; the torch samplers load torch on first use.
"""

# --- elastic data (issue 5): samplers; torch is imported lazily on first access ---
_DATA_EXPORTS = {
    "ElasticDistributedSampler": "._distributed_sampler",
    "ShardSampler": "._shard_sampler",
    "CountingLoader": "._counting",
}

__all__ = list(_DATA_EXPORTS)


def __getattr__(name):
    module = _DATA_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
# --- end elastic data ---

# --- fault-tolerant agent (issue 6): imports no framework; torch only when used ---
from elastic._errors import ElasticError  # noqa: E402
from elastic._diagnosis import Action, Diagnosis, Kind, diagnose  # noqa: E402
from elastic._options import AgentOptions, ExitCode, OnHang  # noqa: E402
from elastic._agent import Agent, current_agent, start_agent  # noqa: E402
from elastic._node_check import NodeCheckResult, Straggler, check_node, find_stragglers  # noqa: E402

__all__ += [
    "Action", "Agent", "AgentOptions", "Diagnosis", "ElasticError", "ExitCode", "Kind",
    "NodeCheckResult", "OnHang", "Straggler", "check_node", "current_agent", "diagnose",
    "find_stragglers", "start_agent",
]
# --- end fault-tolerant agent ---
