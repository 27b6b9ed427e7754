"""pyagent-eviction: LFU, ARC and S3-FIFO prefix-cache eviction policies for
pyagent-framework (see ``pyagent_eviction.lfu``, ``.arc`` and ``.s3fifo``)."""
