"""Lower KV tiers under the prefix cache: host memory, then a disk folder kept across restarts.

``store.TieredBlockStore`` is what the block manager and the worker talk to; ``disk`` holds the
file format and the folder's index, ``host`` the slab of host memory, ``fingerprint`` which
model and settings a folder belongs to, ``folders`` what ``pagedllm kv-cache ls|clear`` show
and remove (no torch there, so the command answers at once).
"""
