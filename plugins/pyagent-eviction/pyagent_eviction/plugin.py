"""Hook implementations of pyagent-eviction.

The entry point ``eviction`` in the ``pyagent_framework`` group names this module. The
policies are registered as lazy ``"module:attr"`` strings, so listing plugins imports
none of them.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_eviction_policies(register):
    register(
        "lfu",
        "pyagent_eviction.lfu:LFUPolicy",
        description="fewest uses first; ties: least recently released",
    )
    register(
        "arc",
        "pyagent_eviction.arc:ARCPolicy",
        description="adaptive replacement cache: once-used vs reused blocks, adaptive split",
    )
    register(
        "s3fifo",
        "pyagent_eviction.s3fifo:S3FIFOPolicy",
        description="S3-FIFO: small probation FIFO (10%) + main FIFO with 2-bit CLOCK reinsertion",
    )
